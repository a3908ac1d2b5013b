"""Tokenizer and chat template.

Built with the `tokenizers` library, from a tokenizer.json or from GGUF metadata (BPE
"gpt2" style and SentencePiece "llama" style). The chat template is the model's own
jinja template, rendered with jinja2 in a sandbox.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from kvferry import KvferryError

# Pre-tokenizer split patterns by GGUF `tokenizer.ggml.pre` (the published regexes of
# these model families); anything else uses GPT-2's, built into ByteLevel.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_PATTERNS = {"llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "smaug-bpe": _LLAMA3,
                "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "deepseek-llm": _QWEN2}
# token texts that end a turn in common chat formats (llama.cpp treats them as EOG too)
END_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>", "<end_of_turn>", "<|eom_id|>", "</s>")


@dataclass
class Tokenizer:
    tok: object  # tokenizers.Tokenizer
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None
    eog_ids: set[int] = field(default_factory=set)
    post_processor_bos: bool = False  # tokenizer.json's post-processor adds BOS itself

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=add_special and self.post_processor_bos).ids
        if add_special and self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def token_text(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise KvferryError("this model has no chat template; drop --chat and pass the raw prompt")
        return render_chat(self.chat_template, messages, add_generation_prompt,
                           bos_token=self._text(self.bos_id), eos_token=self._text(self.eos_id))

    def _text(self, i):
        return "" if i is None else (self.tok.id_to_token(i) or "")


def render_chat(template: str, messages, add_generation_prompt, **special) -> str:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise KvferryError(f"chat template: {msg}")

    def strftime_now(fmt):
        import datetime
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

    def tojson(x, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
        return json.dumps(x, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **special)
    except jinja2.TemplateError as e:
        raise KvferryError(f"the model's chat template failed to render: {e}") from None


def _eog(tok, ids_hint: list[int | None]) -> set[int]:
    out = {i for i in ids_hint if i is not None}
    for text in END_TEXTS:
        i = tok.token_to_id(text)
        if i is not None:
            out.add(i)
    return out


# ---------------------------------------------------------------------------- GGUF
def from_gguf(reader) -> Tokenizer:
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTok

    from kvferry.model.loader import gguf_field

    kind = gguf_field(reader, "tokenizer.ggml.model")
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise KvferryError("the GGUF file has no tokenizer (tokenizer.ggml.tokens missing)")
    types = gguf_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    unk = gguf_field(reader, "tokenizer.ggml.unknown_token_id")
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges") or []]
        tok = HFTok(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        pre = gguf_field(reader, "tokenizer.ggml.pre", "default")
        if pre in PRE_PATTERNS:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(PRE_PATTERNS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        else:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        add_bos_default = False
    elif kind == "llama":
        scores = gguf_field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
        tok = HFTok(models.BPE(vocab, _spm_merges(tokens, scores, vocab), unk_token=tokens[unk] if unk is not None else None,
                               fuse_unk=True, byte_fallback=True))
        # SentencePiece's dummy prefix: "▁" before each stretch of text (llama.cpp adds it
        # at the start and again after every special token, as the normalizer does here,
        # since it runs on each piece between added tokens). Models may switch it off.
        space_prefix = bool(gguf_field(reader, "tokenizer.ggml.add_space_prefix", True))
        norm = [normalizers.Replace(" ", "▁")]
        dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if space_prefix:
            norm.insert(0, normalizers.Prepend("▁"))
            dec.append(decoders.Strip(" ", 1, 0))
        tok.normalizer = normalizers.Sequence(norm)
        tok.decoder = decoders.Sequence(dec)
        add_bos_default = True
    else:
        raise KvferryError(f"unsupported GGUF tokenizer model '{kind}' (supported: gpt2, llama)")
    # unknown (2), control (3) and user-defined (4) tokens are matched whole in the text, as
    # llama.cpp does; the first two are special (dropped when decoding with skip_special)
    specials = [AddedToken(tokens[i], special=(t in (2, 3)), normalized=False)
                for i, t in enumerate(types) if t in (2, 3, 4)]
    tok.add_tokens(specials)
    add_bos = bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", add_bos_default))
    eot = gguf_field(reader, "tokenizer.ggml.eot_token_id")
    eom = gguf_field(reader, "tokenizer.ggml.eom_token_id")
    return Tokenizer(tok, bos, eos, add_bos, gguf_field(reader, "tokenizer.chat_template"), _eog(tok, [eos, eot, eom]))


def _spm_merges(tokens, scores, vocab):
    # SentencePiece-BPE ships scores, not merges: a merge exists where both halves of a
    # token are tokens; rank merges by the merged token's score (higher merges first)
    merges = []
    for tok, i in vocab.items():
        for k in range(1, len(tok)):
            a, b = tok[:k], tok[k:]
            if a in vocab and b in vocab:
                merges.append((scores[i], vocab[a], vocab[b], a, b))
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    return [(a, b) for _, _, _, a, b in merges]


# ---------------------------------------------------------------------------- HF dir
def from_hf_dir(path: str) -> Tokenizer:
    from tokenizers import Tokenizer as HFTok
    tj = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tj):
        raise KvferryError(f"{path} has no tokenizer.json")
    tok = HFTok.from_file(tj)
    conf = _read_json(os.path.join(path, "tokenizer_config.json"))
    gen = _read_json(os.path.join(path, "generation_config.json"))

    def tid(x):
        if isinstance(x, dict):
            x = x.get("content")
        return tok.token_to_id(x) if isinstance(x, str) else None

    bos, eos = tid(conf.get("bos_token")), tid(conf.get("eos_token"))
    gen_eos = gen.get("eos_token_id")
    hint = [eos] + (gen_eos if isinstance(gen_eos, list) else [gen_eos])
    template = conf.get("chat_template")
    tmpl_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(tmpl_file):
        with open(tmpl_file) as f:
            template = f.read()
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    # the tokenizer.json post-processor adds BOS where the model wants it
    return Tokenizer(tok, bos, eos, False, template, _eog(tok, hint), post_processor_bos=True)


def _read_json(p):
    if not os.path.isfile(p):
        return {}
    with open(p) as f:
        return json.load(f)
