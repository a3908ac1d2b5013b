"""The tokenizer kvferry builds from GGUF metadata, checked against transformers' own GGUF
tokenizer loader: the default model's byte-level BPE vocabulary, and a tiny SentencePiece
("llama") vocabulary written for the test. Also the chat template and streaming decode."""

import os

import pytest

from gguf_factory import SPM_CONTROL, spm_vocab, write_bpe_qwen2, write_spm_llama
from kvferry import KvferryError
from kvferry.engine.textstream import TextStream
from kvferry.model import tokenizer as tokmod
from kvferry.model.loader import open_gguf

# text the two tokenizers must split identically
TEXTS = [
    "Hello world",
    "café naïve résumé Ωμέγα Привет",  # accents, Greek, Cyrillic
    "e\u0301 combining accent, \u00a0no-break space, \u200bzero width",
    "日本語のテキスト 한국어 中文",  # CJK
    "emoji 🤖🎉 and a family 👨\u200d👩\u200d👧",  # 4-byte characters and ZWJ
    "two  spaces, three   spaces,\ttab\t\ttabs",
    "lines\n\nblank line\r\nCRLF\n\n\n",
    "trailing spaces   ",
    "   leading spaces",
    " ",
    "\n",
    "12345678901234567890 3.14159 1,000,000 x1000y 2024-01-01T12:00:00Z",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|>b <|endoftext|> c<|endoftext|><|endoftext|>",
    "text <|im_end|> more",
    "<|im_start",  # not a special token: a prefix of one
    "def f(x):\n    return {'k': x ** 2}  # square\n\tif a && b || !c: pass\n",
    "I'm sure you'll see THEY'RE here; don't",
    "\x00control\x01bytes\x7f",
    "",
]
# the same, minus the ones whose special tokens a skip-special decode drops
PLAIN = [t for t in TEXTS if "<|" not in t or "<|im_start" == t]


@pytest.fixture(scope="module")
def tok(engine):
    return engine.tokenizer


@pytest.fixture(scope="module")
def hf(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))


# ---------------------------------------------------------------------------- default model (byte-level BPE)
@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(tok, hf, text):
    assert tok.encode(text) == hf.encode(text, add_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_of_encode_round_trips_with_special_tokens_kept(tok, text):
    assert tok.decode(tok.encode(text), skip_special=False) == text


@pytest.mark.parametrize("text", PLAIN)
def test_decode_of_encode_round_trips(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_special_token_text_becomes_one_id(tok):
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert tok.encode("x<|endoftext|>y") == [104, 0, 105]
    assert tok.decode([104, 0, 105]) == "xy"  # skipped as special by default


def test_bos_eos_and_end_of_generation_ids(tok, hf):
    assert (tok.bos_id, tok.eos_id) == (hf.bos_token_id, hf.eos_token_id) == (1, 2)
    assert tok.token_text(2) == "<|im_end|>" and tok.token_text(0) == "<|endoftext|>"
    assert {0, 2} <= tok.eog_ids
    assert 1 not in tok.eog_ids
    # this GGUF says add_bos_token=false, and transformers agrees: no BOS in front
    assert not tok.add_bos
    assert tok.encode("hi")[0] != 1
    assert tok.vocab_size == len(hf) == 49152


@pytest.mark.parametrize("messages, gen", [
    ([{"role": "user", "content": "hi"}], True),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2? 🤔"},
      {"role": "assistant", "content": "4"}, {"role": "user", "content": "and  3+3?\n"}], True),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], False),
])
def test_chat_template_renders_as_transformers(tok, hf, messages, gen):
    ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
    assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert tok.encode(ours) == hf.encode(ours)


def test_default_chat_template_adds_generation_prompt(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# ---------------------------------------------------------------------------- byte-level BPE split rules
# merges that join digits and words: whether "12" becomes one token depends on the
# pre-tokenizer the file names (Qwen2's splits digits one by one, GPT-2's and Llama 3's do not)
BPE_MERGES = ["1 2", "Ġ 1", "Ġ1 2", "h e", "he l", "hel l", "hell o", "Ġ hello", "Ġ w"]


@pytest.mark.parametrize("pre", ["default", "qwen2", "deepseek-r1-qwen", "llama-bpe", "llama-v3", "smaug-bpe"])
def test_bpe_pre_tokenizer_named_in_the_file_matches_transformers(tmp_path, pre):
    transformers = pytest.importorskip("transformers")
    path = write_bpe_qwen2(tmp_path / "bpe.gguf", pre, BPE_MERGES)
    ours = tokmod.from_gguf(open_gguf(path))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="bpe.gguf")
    for text in ["hello 12 1234 x12", "hello<|endoftext|> 12", " hello  world\n\n12"]:
        assert ours.encode(text) == hf.encode(text), text
    digits_split = pre in ("qwen2", "deepseek-r1-qwen")
    assert len(ours.encode("12")) == (2 if digits_split else 1)


# ---------------------------------------------------------------------------- SentencePiece ("llama") vocabulary
SPM_TEXTS = [
    "hello world",
    "The cat is here",
    "the end, and it's hello!",
    "café",
    "世界 世界",  # pieces
    "emoji 🤖 and 中",  # byte fallback
    "hello  world",
    "trailing  ",
    "tab\there\nnew line",
    "Hello World 1234",
    "",
]


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory):
    return write_spm_llama(tmp_path_factory.mktemp("spm") / "tiny-spm.gguf")


@pytest.fixture(scope="module")
def spm(spm_file):
    return tokmod.from_gguf(open_gguf(spm_file))


@pytest.fixture(scope="module")
def spm_hf(spm_file):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(spm_file), gguf_file=os.path.basename(spm_file))


def spm_ids(*pieces):
    tokens = spm_vocab()[0]
    return [tokens.index(p) for p in pieces]


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_spm_ids_match_transformers(spm, spm_hf, text):
    assert spm.encode(text) == spm_hf.encode(text)


@pytest.mark.parametrize("text", SPM_TEXTS + ["  leading", " ", "a\n\n", "   "])
def test_spm_decode_of_encode_round_trips(spm, text):
    assert spm.decode(spm.encode(text)) == text


def test_spm_splits_words_by_merge_score(spm):
    assert spm.encode("hello the world") == spm_ids("<s>", "▁hello", "▁the", "▁world")
    # "▁end" is no piece: "▁" + "e" + "nd" (the only merge available)
    assert spm.encode("end", add_special=False) == spm_ids("▁", "e", "nd")


def test_spm_unknown_characters_fall_back_to_bytes(spm):
    assert spm.encode("🤖", add_special=False) == spm_ids("▁", "<0xF0>", "<0x9F>", "<0xA4>", "<0x96>")


def test_spm_bos_eos_and_end_of_generation_ids(spm, spm_hf):
    assert (spm.bos_id, spm.eos_id) == (spm_hf.bos_token_id, spm_hf.eos_token_id) == (1, 2)
    assert spm.add_bos and spm.encode("hi")[0] == 1
    assert spm.encode("hi", add_special=False)[0] != 1
    assert spm.eog_ids == {2, spm_ids("<|im_end|>")[0]}


def test_spm_special_and_unknown_token_text_becomes_one_id(spm, spm_hf):
    for text in ["<unk>", "</s>"] + SPM_CONTROL:
        assert spm.encode(text, add_special=False) == spm_hf.encode(text, add_special_tokens=False) == spm_ids(text)


def test_spm_leading_spaces_keep_the_dummy_prefix(spm):
    # SentencePiece (and llama.cpp) prefix "▁" and then turn every space into "▁": "  x"
    # has three. transformers' GGUF loader uses Metaspace(prepend_scheme="first"), which skips
    # the prefix when the text already starts with a space and so loses one on decode; this
    # case is checked against the hand-computed SentencePiece answer instead.
    assert spm.encode("  leading") == spm_ids("<s>", "▁▁▁", "l", "e", "a", "d", "in", "g")
    assert spm.encode(" ") == spm_ids("<s>", "▁▁")


def test_spm_text_after_a_special_token_gets_the_dummy_prefix(spm):
    # llama.cpp (and Llama's own tokenizer.json, "legacy" mode) start every stretch of text
    # after a special token with "▁"; transformers' GGUF loader does not (non-legacy).
    # Hand-computed, llama.cpp's way:
    assert spm.encode("hello<|im_end|>world") == spm_ids("<s>", "▁hello", "<|im_end|>", "▁world")


def test_spm_prompt_starting_with_bos_text_gets_no_second_bos(spm):
    assert spm.encode("<s>hello") == spm_ids("<s>", "▁hello")


def test_spm_without_space_prefix_adds_no_dummy_prefix(tmp_path):
    # tokenizer.ggml.add_space_prefix=false (llama.cpp honours it; transformers' GGUF
    # loader ignores it, so the expectation is hand-computed)
    tok = tokmod.from_gguf(open_gguf(write_spm_llama(tmp_path / "noprefix.gguf", add_space_prefix=False)))
    assert tok.encode("hello world") == spm_ids("<s>", "he", "llo", "▁world")
    assert tok.decode(tok.encode(" hello world")) == " hello world"
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_model_without_chat_template_says_so(spm):
    with pytest.raises(KvferryError, match="no chat template"):
        spm.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_errors_become_kvferry_errors():
    with pytest.raises(KvferryError, match="chat template"):
        tokmod.render_chat("{{ raise_exception('roles must alternate') }}", [], True)
    with pytest.raises(KvferryError, match="failed to render"):
        tokmod.render_chat("{% for %}", [], True)


def test_chat_template_tojson_takes_transformers_arguments():
    out = tokmod.render_chat("{{ messages[0] | tojson(indent=None, separators=(',', ':'), sort_keys=true) }}",
                             [{"role": "user", "content": "é"}], False)
    assert out == '{"content":"é","role":"user"}'


# ---------------------------------------------------------------------------- streaming decode
STREAM_TEXTS = [
    "Hello wörld 🤖🎉 日本語 café\n  code: x = 1234567;",
    "🤖🎉👨\u200d👩\u200d👧" * 5 + " the end",
    "plain words " * 30,
]


def _stream(tok, ids):
    s = TextStream(tok)
    chunks = [s.push(i) for i in ids]
    chunks.append(s.flush())
    return chunks


@pytest.mark.parametrize("which", ["bpe", "spm"])
@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_streamed_text_equals_the_full_decode(tok, spm, which, text):
    t = tok if which == "bpe" else spm
    ids = t.encode(text)
    chunks = _stream(t, ids)
    assert "".join(chunks) == t.decode(ids)
    assert not any("\ufffd" in c for c in chunks)  # no half characters released


def test_streaming_decodes_a_bounded_window_per_token(tok):
    class Counting:
        def __init__(self, inner):
            self.inner, self.longest = inner, 0

        def decode(self, ids, skip_special=True):
            self.longest = max(self.longest, len(ids))
            return self.inner.decode(ids, skip_special)

    ids = tok.encode("Streaming should not re-decode everything 🤖 日本語. " * 100)
    counting = Counting(tok)
    s = TextStream(counting)
    out = "".join(s.push(i) for i in ids) + s.flush()
    assert out == tok.decode(ids)
    assert len(ids) > 1000 and counting.longest <= 64
