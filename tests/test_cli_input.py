"""How the CLI starts and takes its input: --help and flag errors return without importing
torch, error hints name the command that was given the flag, and -f reads a file or
standard input the way llama.cpp does."""

import argparse
import pathlib

import pytest

from conftest import ROOT, run_cli
from kvferry import KvferryError
from kvferry.config import KV_TYPES
from kvferry.run import read_prompts


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["bench", "--help"], ["serve", "--help"], ["serve", "--port", "x"],
                                  ["run", "-p", "hi", "--bogus"], ["bench", "-n", "x"]])
def test_help_and_flag_errors_return_without_importing_torch(args):
    r = run_cli(*args)
    assert r.returncode == (0 if "--help" in args else 1), r.stderr
    assert ("usage: kvferry" in r.stdout) == ("--help" in args)
    assert not r.torch_imported


@pytest.mark.parametrize("args,hint", [
    (["bogus"], "(see `kvferry --help`)"),
    (["--bogus"], "(see `kvferry --help`)"),
    (["run", "-p", "hi", "--bogus"], "(see `kvferry run --help`)"),
    (["run", "-n", "x"], "(see `kvferry run --help`)"),
    (["bench", "--bogus"], "(see `kvferry bench --help`)"),
])
def test_error_hint_names_the_command_that_was_given_the_flag(args, hint):
    r = run_cli(*args)
    assert r.returncode == 1 and r.stderr.strip().endswith(hint), r.stderr


def test_only_the_entry_points_import_cli():
    # the commands share flags through kvferry.args; cli.py only builds the top parser
    importers = sorted(str(p.relative_to(ROOT)) for d in ("kvferry", "benchmarks") for p in pathlib.Path(ROOT, d).rglob("*.py")
                       if "kvferry.cli" in p.read_text() or "from kvferry import cli" in p.read_text())
    assert importers == ["kvferry/__main__.py"]


def test_kv_type_names_in_config_match_the_encodings():
    from kvferry.kv import quant
    assert KV_TYPES == quant.KV_TYPES


# ---------------------------------------------------------------------------- -f
def _prompts(tmp_path, data: bytes, parallel=1):
    p = tmp_path / "prompt.txt"
    p.write_bytes(data)
    return read_prompts(argparse.Namespace(prompt=None, file=str(p), parallel=parallel))


def test_file_prompt_drops_one_trailing_newline(tmp_path):
    assert _prompts(tmp_path, b"hello\n") == ["hello"]
    assert _prompts(tmp_path, b"hello\n\n") == ["hello\n"]
    assert _prompts(tmp_path, b"hello") == ["hello"]
    assert _prompts(tmp_path, b"one\r\ntwo\r\n") == ["one\ntwo"]


def test_file_with_np_gives_one_prompt_per_nonblank_line(tmp_path):
    assert _prompts(tmp_path, b"one\n\ntwo\n", parallel=2) == ["one", "two"]
    with pytest.raises(KvferryError, match="holds no prompt"):
        _prompts(tmp_path, b"\n \n", parallel=2)


def test_f_dash_reads_the_prompt_from_stdin():
    r = run_cli("run", "-f", "-", "-n", "4", "--temp", "0", "--device", "cpu", "--no-progress",
                input="The capital of France is\n")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout
