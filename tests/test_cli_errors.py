"""Bad input to `kvferry run` ends with a non-zero exit code and one `error:` line on stderr
that names the problem, never a traceback (unless -v asks for one). Also the loader's
messages for files that are cut short or corrupt, checked in-process."""

import os
import shutil

import pytest

import gguf
import torch
from conftest import run_cli
from gguf_factory import write_arch, write_llama_with_qtype, write_spm_llama
from kvferry import KvferryError
from kvferry.model.loader import load_model

LONG_PROMPT = " ".join(["word"] * 60)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def files(tmp_path_factory, gguf_path):
    d = tmp_path_factory.mktemp("cli")
    with open(gguf_path, "rb") as src, open(d / "truncated.gguf", "wb") as dst:
        dst.write(src.read(1 << 20))
    return {
        "truncated": str(d / "truncated.gguf"),
        "gpt2": write_arch(d / "gpt2.gguf", "gpt2"),
        "bert": write_arch(d / "bert.gguf", "bert"),
        "iq2_xxs": write_llama_with_qtype(d / "iq2.gguf", gguf.GGMLQuantizationType.IQ2_XXS),
        "tq1_0": write_llama_with_qtype(d / "tq1.gguf", gguf.GGMLQuantizationType.TQ1_0),
        "tiny": write_spm_llama(d / "tiny.gguf"),
        "latin1": _write(d / "latin1.txt", "café au lait\n".encode("latin-1")),
        "blank": _write(d / "blank.txt", b"\n"),
        "dir": str(d),
        "hf_broken": os.path.dirname(_write(d / "hf" / "config.json", b'{"model_type": "llama",\n  "hidden_size": 16,,\n}')),
    }


def _write(path, data: bytes) -> str:
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return str(path)


def _error_line(res):
    """The single error line of a failed run (log lines "I ..."/"W ..." aside)."""
    assert res.returncode != 0, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("error: "), res.stderr
    rest = [ln for ln in lines if not ln.startswith(("I ", "W "))]
    assert rest == [lines[-1]], res.stderr  # nothing else: no usage dump, no second error
    assert res.stdout == ""
    return lines[-1]


# (args, what the error line must contain); "{x}" is filled from the files fixture
CASES = {
    "missing model file": (["-m", "/nonexistent.gguf"], ["model file not found", "/nonexistent.gguf"]),
    "truncated gguf": (["-m", "{truncated}"], ["truncated or corrupt", "truncated.gguf"]),
    "unsupported architecture gpt2": (["-m", "{gpt2}"], ["unsupported architecture 'gpt2'", "gpt2.gguf"]),
    "unsupported architecture bert": (["-m", "{bert}"], ["unsupported architecture 'bert'"]),
    "unsupported quant IQ2_XXS": (["-m", "{iq2_xxs}"], ["IQ2_XXS", "blk.0.ffn_down.weight", "does not load"]),
    "unsupported quant TQ1_0": (["-m", "{tq1_0}"], ["TQ1_0", "does not load"]),
    "prompt longer than the context": (["-c", "16", "-p", LONG_PROMPT], ["context is 16", "raise -c"]),
    "negative token count": (["-n", "-5"], ["-n must be >= 0", "-5"]),
    "unknown kv type": (["-m", "{tiny}", "--kv-type", "q3_bogus"], ["KV type", "q3_bogus"]),
    "bad device name": (["--device", "tpu"], ["--device", "tpu"]),
    "absent gpu": (["--device", "cuda:99"], ["cuda"]),
    "non-integer token count": (["-n", "lots"], ["-n", "lots"]),
    "nan temperature": (["-m", "{tiny}", "--temp", "nan"], ["--temp", "nan"]),
    "unknown flag names the run command": (["--bogus"], ["unrecognized arguments: --bogus", "`kvferry run --help`"]),
    "prompt and file together": (["-p", "hi", "-f", "{latin1}"], ["-p or with -f, not both"]),
    "empty prompt": (["-p", ""], ["-p is empty"]),
    # a byte that is not UTF-8 on the command line reaches Python as a lone surrogate
    "prompt bytes not UTF-8": (["-p", "caf\udce9"], ["-p is not valid UTF-8", "0xe9"]),
    "prompt file not UTF-8": (["-f", "{latin1}"], ["latin1.txt is not UTF-8", "0xe9 on line 1, offset 3"]),
    "prompt file holds only a newline": (["-f", "{blank}"], ["blank.txt is empty"]),
    "prompt file is a directory": (["-f", "{dir}"], ["cannot read the prompt", "Is a directory"]),
    "missing prompt file": (["-f", "/nonexistent.txt"], ["/nonexistent.txt", "No such file"]),
    "broken config.json": (["-m", "{hf_broken}"], ["config.json is not valid JSON", "line 2, column 21"]),
    "bad device budget": (["-nkvo", "--kv-device-budget", "lots"], ["--kv-device-budget", "number or auto", "lots"]),
    "negative device budget": (["-nkvo", "--kv-device-budget", "-5"], ["--kv-device-budget", ">= 0 or auto"]),
    "device budget without -nkvo": (["--kv-device-budget", "auto"], ["--kv-device-budget", "add -nkvo"]),
    "bad ring budget": (["-nkvo", "-kvpb", "lots"], ["-kvpb", "number or auto", "lots"]),
    "nan ring budget": (["-nkvo", "-kvpb", "nan"], ["-kvpb", ">= 0", "or auto"]),
    "bad chunk rows": (["--kv-chunk", "wide"], ["--kv-chunk", "integer or auto", "wide"]),
    "zero chunk rows": (["--kv-chunk", "0"], ["--kv-chunk", ">= 1 row or auto"]),
    "host KV cache beyond memory": (["-m", "{tiny}", "-c", "100000000000", "-nkvo"],
                                    ["KV cache needs", "12800000000000 bytes", "GiB of memory", "lower -c or -np", "-ctk"]),
    "CPU KV cache beyond memory": (["-m", "{tiny}", "-c", "100000000000", "-ctk", "f16"],
                                   ["KV cache needs", "GiB of memory", "lower -c or -np"]),
}
# cases caught before torch is imported, so before any model load
BEFORE_TORCH = {"negative token count", "unknown kv type", "bad device name", "non-integer token count",
                "nan temperature", "unknown flag names the run command", "prompt and file together",
                "empty prompt", "prompt bytes not UTF-8", "prompt file not UTF-8",
                "prompt file holds only a newline", "prompt file is a directory", "missing prompt file",
                "bad device budget", "negative device budget", "device budget without -nkvo", "bad ring budget",
                "nan ring budget", "bad chunk rows", "zero chunk rows"}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gives_one_error_line(files, case):
    args, expect = CASES[case]
    args = [a.format(**files) for a in args]
    if "-p" not in args and "-f" not in args:
        args += ["-p", "hello"]
    if "-n" not in args:
        args += ["-n", "2"]
    if "--device" not in args:
        args += ["--device", "cpu"]
    res = run_cli("run", *args, "--no-progress")
    line = _error_line(res)
    for part in expect:
        assert part in line, line
    assert res.torch_imported == (case not in BEFORE_TORCH)


def test_verbose_flag_shows_the_traceback():
    res = run_cli("run", "-m", "/nonexistent.gguf", "-p", "hi", "--device", "cpu", "-v")
    assert res.returncode != 0
    assert "Traceback" in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: model file not found")


# ---------------------------------------------------------------------------- loader, in-process
@pytest.fixture(scope="module")
def tiny_bytes(files):
    with open(files["tiny"], "rb") as f:
        return f.read()


@pytest.mark.parametrize("keep", [0, 3, 7, 20, 200, 2000, 12000, 30000, -100, -1])
def test_file_cut_short_is_reported_as_truncated_or_corrupt(tmp_path, tiny_bytes, keep):
    # cuts through the magic, the header, the metadata, the tensor table and the tensor data
    p = tmp_path / "cut.gguf"
    p.write_bytes(tiny_bytes[:keep])
    with pytest.raises(KvferryError, match="truncated or corrupt") as e:
        load_model(str(p), torch.float32, progress=False)
    assert str(p) in str(e.value)
    assert "\n" not in str(e.value)


def test_tensor_data_that_fails_to_decode_is_reported_as_truncated_or_corrupt(tmp_path, monkeypatch):
    p = write_llama_with_qtype(tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    assert load_model(p, torch.float32, progress=False).weights["layers.0.w_down"].shape == (16, 32)

    def short_read(data, qtype):
        raise ValueError("cannot reshape array of size 100 into shape (16,34)")

    monkeypatch.setattr(gguf.quants, "dequantize", short_read)
    with pytest.raises(KvferryError, match="truncated or corrupt") as e:
        load_model(p, torch.float32, progress=False)
    assert p in str(e.value) and "blk.0.ffn_down.weight" in str(e.value)


def test_unsupported_quant_is_rejected_before_any_weight_is_read(files, monkeypatch):
    def no_reads(*a, **k):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(gguf.quants, "dequantize", no_reads)
    with pytest.raises(KvferryError, match="IQ2_XXS"):
        load_model(files["iq2_xxs"], torch.float32, upload=no_reads, progress=False)


def test_file_without_architecture_says_so(tmp_path):
    p = write_arch(tmp_path / "noarch.gguf", "")
    with pytest.raises(KvferryError, match="general.architecture"):
        load_model(p, torch.float32, progress=False)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file_says_it_cannot_be_opened(tmp_path, files):
    p = tmp_path / "locked.gguf"
    shutil.copy(files["tiny"], p)
    p.chmod(0)
    with pytest.raises(KvferryError, match="cannot open"):
        load_model(str(p), torch.float32, progress=False)
