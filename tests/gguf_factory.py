"""Tiny GGUF files written with gguf.GGUFWriter, for tests that need a file of a given shape
(a SentencePiece vocabulary, an architecture or a tensor type kvferry does not load) without
downloading anything. Every builder returns the path it wrote."""

from __future__ import annotations

import numpy as np

import gguf

HIDDEN, HEADS, FFN, LAYERS, CTX = 16, 2, 32, 1, 64

# SentencePiece-style vocabulary: pieces listed best merge first, so a piece's score falls
# with its position (as in the llama tokenizer, where score ranks merges).
SPM_CHARS = list("▁abcdefghijklmnoprstuwyTHI,.!?'") + ["é", "世", "界"]
SPM_PIECES = [
    "▁t", "he", "▁the", "▁h", "ll", "llo", "▁he", "▁hel", "▁hello", "▁w", "or", "▁wor", "ld",
    "▁world", "in", "▁a", "an", "▁an", "nd", "▁and", "is", "▁is", "▁T", "▁Th", "▁The", "er",
    "▁c", "af", "▁caf", "▁café", "▁I", "▁▁", "▁▁▁", "▁▁▁▁", "世界", "▁世界", "it", "▁it", "'s",
]
SPM_CONTROL = ["<|im_start|>", "<|im_end|>"]


def spm_vocab():
    """(tokens, scores, types) of a small llama-style vocabulary."""
    T = gguf.TokenType
    tokens, scores, types = ["<unk>", "<s>", "</s>"], [0.0, 0.0, 0.0], [T.UNKNOWN, T.CONTROL, T.CONTROL]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        scores.append(0.0)
        types.append(T.BYTE)
    for i, p in enumerate(SPM_PIECES):
        tokens.append(p)
        scores.append(-float(i))
        types.append(T.NORMAL)
    for i, c in enumerate(SPM_CHARS):
        tokens.append(c)
        scores.append(-1000.0 - i)
        types.append(T.NORMAL)
    for c in SPM_CONTROL:
        tokens.append(c)
        scores.append(0.0)
        types.append(T.CONTROL)
    return tokens, scores, [int(t) for t in types]


def _llama_meta(w: gguf.GGUFWriter, vocab_size: int, arch: str = "llama"):
    w.add_name("tiny-test")
    w.add_context_length(CTX)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab_size)


def _spm_tokenizer_meta(w: gguf.GGUFWriter, add_space_prefix: bool | None = True):
    tokens, scores, types = spm_vocab()
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    return len(tokens)


def _llama_tensors(w: gguf.GGUFWriter, vocab_size: int, odd: tuple[str, gguf.GGMLQuantizationType] | None = None):
    rng = np.random.default_rng(0)

    def f32(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    w.add_tensor("token_embd.weight", f32(vocab_size, HIDDEN))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(HIDDEN, np.float32))
        for name, shape in (("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (HIDDEN, HIDDEN)), ("attn_v", (HIDDEN, HIDDEN)),
                            ("attn_output", (HIDDEN, HIDDEN)), ("ffn_gate", (FFN, HIDDEN)),
                            ("ffn_up", (FFN, HIDDEN)), ("ffn_down", (HIDDEN, FFN))):
            full = p + name + ".weight"
            if odd is not None and full == odd[0]:
                qtype = odd[1]
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
                rows, cols = shape
                if cols % block == 0:
                    try:  # real quantized data where the gguf package can make it
                        w.add_tensor(full, gguf.quants.quantize(f32(*shape), qtype), raw_dtype=qtype)
                        continue
                    except NotImplementedError:
                        pass
                # zero blocks; a row shorter than one block is padded to a whole block
                raw = np.zeros((rows, -(-cols // block) * type_size), np.uint8)
                w.add_tensor(full, raw, raw_dtype=qtype)
            else:
                w.add_tensor(full, f32(*shape))


def _write(w: gguf.GGUFWriter):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_spm_llama(path, add_space_prefix: bool | None = True) -> str:
    """A working (random-weight) llama model with a SentencePiece vocabulary."""
    w = gguf.GGUFWriter(str(path), "llama")
    n = _spm_tokenizer_meta(w, add_space_prefix)
    _llama_meta(w, n)
    _llama_tensors(w, n)
    _write(w)
    return str(path)


def write_arch(path, arch: str) -> str:
    """A file that claims architecture `arch` (with llama-shaped metadata and tensors)."""
    w = gguf.GGUFWriter(str(path), arch)
    n = _spm_tokenizer_meta(w)
    for k, v in (("context_length", CTX), ("embedding_length", HIDDEN), ("block_count", LAYERS),
                 ("feed_forward_length", FFN), ("attention.head_count", HEADS)):
        w.add_uint32(f"{arch}.{k}", v)
    _llama_tensors(w, n)
    _write(w)
    return str(path)


def write_llama_with_qtype(path, qtype: gguf.GGMLQuantizationType, tensor: str = "blk.0.ffn_down.weight") -> str:
    """A llama file whose `tensor` is stored as `qtype`: quantized data where the gguf package
    can quantize to it (ffn_down rows hold 32 values, one Q8_0 block), else zero bytes of the
    right size."""
    w = gguf.GGUFWriter(str(path), "llama")
    n = _spm_tokenizer_meta(w)
    _llama_meta(w, n)
    _llama_tensors(w, n, odd=(tensor, qtype))
    _write(w)
    return str(path)


def byte_alphabet() -> list[str]:
    """The 256 characters byte-level BPE vocabularies spell bytes with, in byte order:
    printable Latin-1 bytes stand for themselves, the rest take code points from 256 up."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def write_bpe_qwen2(path, pre: str, merges: list[str]) -> str:
    """A qwen2-architecture file with a byte-level BPE vocabulary: the 256 byte characters,
    one token per merge result, and an <|endoftext|> control token."""
    T = gguf.TokenType
    tokens = byte_alphabet()
    for m in merges:
        a, b = m.split(" ")
        tokens.append(a + b)
    tokens.append("<|endoftext|>")
    types = [int(T.NORMAL)] * (len(tokens) - 1) + [int(T.CONTROL)]
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 1)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_add_bos_token(False)
    _llama_meta(w, len(tokens))
    _llama_tensors(w, len(tokens))
    _write(w)
    return str(path)
