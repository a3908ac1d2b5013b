"""Incremental detokenization: byte-level tokens can split a UTF-8 character, so text is
released only once it decodes without a trailing replacement character."""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.sent = 0  # characters already released

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        out, self.sent = text[self.sent:], len(text)
        return out

    def flush(self) -> str:
        text = self.tok.decode(self.ids)
        out, self.sent = text[self.sent:], len(text)
        return out
