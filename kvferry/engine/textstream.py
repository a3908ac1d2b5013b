"""Incremental detokenization: byte-level tokens can split a UTF-8 character, so text is
released only once it decodes without a trailing replacement character.

Each push decodes a short window of the latest ids rather than the whole output, so
streaming costs the same per token however long the output grows. The window keeps a
few tokens of left context and only moves to a start whose decode is a suffix of what
has already been released (so a leading space a decoder strips, or a character whose
bytes straddle the cut, never shows up as changed text).
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"


class TextStream:
    CONTEXT = 8  # tokens kept before the new ones; the window is at most 2*CONTEXT + 1

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.base = 0  # the window is ids[base:]
        self.sent = 0  # characters of the window's text already released

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids[self.base:])
        if text.endswith(_REPLACEMENT):
            return ""
        out, self.sent = text[self.sent:], len(text)
        if len(self.ids) - self.base > 2 * self.CONTEXT:
            self._slide(text)
        return out

    def flush(self) -> str:
        text = self.tok.decode(self.ids[self.base:])
        out, self.sent = text[self.sent:], len(text)
        return out

    def _slide(self, text: str):
        start = len(self.ids) - self.CONTEXT
        tail = self.tok.decode(self.ids[start:])
        if text.endswith(tail) and not tail.startswith(_REPLACEMENT):
            self.base, self.sent = start, len(tail)
