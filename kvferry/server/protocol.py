"""The OpenAI request bodies the server accepts, checked by pydantic, and the objects it answers.

Owns: field types and ranges (strict: "5" is not an int, 5.0 is not an int, NaN is not a
float), what is refused because the engine cannot do it (n > 1, logprobs, penalties, echo,
suffix), and the response and chunk objects. Anything wrong here is a 400 before any slow
work (app.py turns pydantic's errors into OpenAI error objects).
Must not: tokenize or touch the engine (app.py does, with these values).

Sampling defaults are the CLI's (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05), as in
llama.cpp's server; `temperature: 0` is greedy. top_k, min_p and ignore_eos are extensions
llama.cpp's and vLLM's servers accept too.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvferry.config import SamplingConfig

MAX_STOPS = 4


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    @model_validator(mode="after")
    def _needs_content(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(SamplingConfig.temperature, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(SamplingConfig.top_p, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(SamplingConfig.top_k, ge=0)
    min_p: float = Field(SamplingConfig.min_p, ge=0, lt=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    # accepted at their neutral values only
    presence_penalty: float = Field(0.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, allow_inf_nan=False)
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _supported(self):
        if self.n != 1:
            raise ValueError(f"n must be 1 (one choice per request), got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported (leave them at 0)")
        if self.logprobs or self.top_logprobs:
            raise ValueError("logprobs are not supported")
        stops = self.stops()
        if len(stops) > MAX_STOPS:
            raise ValueError(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return self

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              min_p=self.min_p, seed=-1 if self.seed is None else self.seed)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    tools: list | None = None

    @model_validator(mode="after")
    def _chat(self):
        if self.tools:
            raise ValueError("tools are not supported")
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _completion(self):
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ValueError(f"one prompt per request (n=1), got a list of {len(self.prompt)}")
            self.prompt = self.prompt[0]
        if not self.prompt:
            raise ValueError("the prompt is empty")
        if self.echo or self.suffix or (self.best_of or 1) != 1:
            raise ValueError("echo, suffix and best_of are not supported")
        return self


# ---------------------------------------------------------------------------- answers
def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Answer:
    """The response and chunk objects of one request (chat or text completion): one id and
    one creation time for all of them."""

    def __init__(self, chat: bool, model: str, request_id: str):
        self.chat, self.model, self.id, self.created = chat, model, request_id, int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str, use: dict, token_ids: list[int] | None) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return {**self._base("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": use}

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False,
              token_ids: list[int] | None = None, with_usage: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        if token_ids:
            choice["token_ids"] = token_ids
        out = {**self._base("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if with_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, use: dict) -> dict:
        return {**self._base("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": use}
