"""The HTTP side: FastAPI routes, OpenAI error objects, the API key and body cap, and the
engine thread's start and stop.

Owns: /v1/chat/completions, /v1/completions (JSON or SSE), /v1/models, /health, /metrics;
turning every failure into {"error": {message, type, param, code}} with the right 4xx (pydantic's
422 becomes 400); the runtime (loading -> ready -> draining) and the one engine thread, which
loads the model and then runs the scheduler. Requests are checked, templated, tokenized and
measured against the context before they are queued, so a bad request costs no engine time and
reaches no other request.
Must not: touch the engine from the event loop (the engine thread owns it; requests reach it
only through Scheduler.submit/cancel).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from kvferry import KvferryError
from kvferry.server.metrics import Metrics
from kvferry.server.protocol import Answer, ChatRequest, CompletionRequest, error_body, usage
from kvferry.server.scheduler import Event, GenParams, NotAccepting, QueueFull, Scheduler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    slots: int
    ctx_size: int
    queue: int  # requests that may wait for a slot
    api_key: str | None
    max_body_bytes: int
    grace_s: float
    alias: str | None  # the model id clients name; default: the model file's name


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


def _error(status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
           param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


# ---------------------------------------------------------------------------- the runtime
class Runtime:
    """The engine thread and what the routes need to know of it. `load` builds the Engine (on
    the engine thread, which then owns it); `make_sampler` turns a SamplingConfig into a sampler;
    `on_fatal(message)` is called if the load fails."""

    def __init__(self, opts: ServeOptions, load: Callable, make_sampler: Callable, on_fatal: Callable[[str], None]):
        self.opts, self._load, self._make_sampler, self._on_fatal = opts, load, make_sampler, on_fatal
        self.metrics = Metrics(opts.slots)
        self.phase = "loading"
        self.scheduler: Scheduler | None = None
        self.model_id = opts.alias
        self.tokenizer = None
        self._thread = threading.Thread(target=self._main, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _main(self) -> None:
        try:
            engine, name = self._load()
        except Exception as e:  # noqa: BLE001 - reported as the command's one error line
            log.debug("load failed", exc_info=True)
            self.phase = "failed"
            self._on_fatal(str(e) if isinstance(e, KvferryError) else f"{type(e).__name__}: {e}")
            return
        self.tokenizer = engine.tokenizer
        self.model_id = self.model_id or name
        self.metrics.attach(engine)
        self.scheduler = Scheduler(engine, self._make_sampler, self.opts.queue, self.metrics)
        if self.phase == "loading":
            self.phase = "ready"
            log.info("serving %s: %d slots of %d positions", self.model_id, self.opts.slots, self.opts.ctx_size)
        try:
            self.scheduler.run()
        finally:
            engine.close()

    def drain(self) -> None:
        """SIGTERM: refuse new requests; running ones get the grace period."""
        if self.phase == "ready":
            self.scheduler.drain(self.opts.grace_s)
        self.phase = "draining" if self.phase != "failed" else self.phase

    def stop(self, timeout: float = 10.0) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)


# ---------------------------------------------------------------------------- middleware
class Gate:
    """Plain ASGI middleware (streaming responses pass untouched): the API key on /v1 routes
    and the body cap, before any route reads the body."""

    def __init__(self, app, api_key: str | None, max_body: int):
        self.app, self.api_key, self.max_body = app, api_key, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and scope["path"].startswith("/v1"):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(auth.encode(), f"Bearer {self.api_key}".encode()):
                return await _error(401, "invalid API key: send Authorization: Bearer KEY", "authentication_error",
                                    "invalid_api_key")(scope, receive, send)
        length = headers.get(b"content-length")
        try:
            if length is not None and int(length) > self.max_body:
                raise OverflowError
        except ValueError:
            return await _error(400, "Content-Length is not a number")(scope, receive, send)
        except OverflowError:
            return await self._too_large(scope, receive, send)
        seen, replied = 0, False

        async def counted_receive():
            nonlocal seen, replied
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_body and not replied:  # a chunked body that grew past the cap
                    replied = True
                    await self._too_large(scope, receive, send)
                    return {"type": "http.disconnect"}
            return msg

        async def guarded_send(msg):
            if not replied:
                await send(msg)

        await self.app(scope, counted_receive, guarded_send)

    async def _too_large(self, scope, receive, send):
        mib = self.max_body / 2**20
        await _error(413, f"the request body is over the {mib:g} MiB limit (--max-body)", code="body_too_large")(
            scope, receive, send)


# ---------------------------------------------------------------------------- the app
def create_app(rt: Runtime) -> FastAPI:
    app = FastAPI(title="kvferry", docs_url=None, redoc_url=None, openapi_url=None)
    _errors(app)

    @app.get("/health")
    async def health():
        if rt.phase != "ready":
            return JSONResponse({"status": rt.phase}, status_code=503)
        s = rt.scheduler
        return {"status": "ok", "slots_idle": s.num_slots - s.num_busy, "slots_processing": s.num_busy,
                "requests_waiting": s.num_waiting}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(rt.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        _ready(rt)
        return {"object": "list", "data": [{"id": rt.model_id, "object": "model", "created": 0, "owned_by": "kvferry",
                                            "meta": {"n_ctx": rt.opts.ctx_size, "slots": rt.opts.slots,
                                                     "tokenizer": rt.tokenizer is not None}}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _body(request, ChatRequest)
        _ready(rt)
        _check_model(rt, body.model)
        tok = _tokenizer(rt)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = await run_in_threadpool(lambda: tok.encode(_template(tok, messages)))
        return await _generate(rt, request, body, ids, Answer(True, rt.model_id, f"chatcmpl-{uuid.uuid4().hex}"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body(request, CompletionRequest)
        _ready(rt)
        _check_model(rt, body.model)
        if isinstance(body.prompt, str):
            tok = _tokenizer(rt)
            ids = await run_in_threadpool(tok.encode, body.prompt)
        else:
            ids = list(body.prompt)
        return await _generate(rt, request, body, ids, Answer(False, rt.model_id, f"cmpl-{uuid.uuid4().hex}"))

    return app


def _errors(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(e.body, status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        # a union's member name (str, list[...]) in the location tells the client nothing
        loc = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "function-after")]
        param = ".".join(loc) or None
        msg = err.get("msg", "invalid request").removeprefix("Value error, ")
        if err.get("type") == "json_invalid":
            msg, param = f"the body is not valid JSON: {err.get('ctx', {}).get('error', msg)}", None
        return _error(400, f"{param}: {msg}" if param else msg, param=param)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        if e.status_code == 404:
            return _error(404, f"no route {request.method} {request.url.path}", code="not_found")
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def unexpected(request, e: Exception):
        log.exception("unexpected error")
        return _error(500, f"internal error: {type(e).__name__}", "server_error")


async def _body(request: Request, model):
    """The JSON body, whatever the Content-Type says (curl -d sends a form type), checked by `model`."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def _ready(rt: Runtime) -> None:
    if rt.phase == "loading":
        raise APIError(503, "the model is loading: retry shortly", "unavailable", code="loading")
    if rt.phase != "ready":
        raise APIError(503, "the server is shutting down", "unavailable", code="shutting_down")


def _check_model(rt: Runtime, model: str | None) -> None:
    if model is not None and model != rt.model_id:
        raise APIError(404, f"the model '{model}' does not exist: this server serves '{rt.model_id}'",
                       param="model", code="model_not_found")


def _tokenizer(rt: Runtime):
    if rt.tokenizer is None:
        raise APIError(400, "this model has no tokenizer: send /v1/completions with the prompt as token ids",
                       param="prompt")
    return rt.tokenizer


def _template(tok, messages) -> str:
    try:
        return tok.apply_chat_template(messages)
    except KvferryError as e:
        raise APIError(400, str(e), param="messages") from None


def _params(rt: Runtime, body, ids: list[int]) -> GenParams:
    """The request measured against the context and the vocabulary: a 400 before any byte."""
    ctx = rt.opts.ctx_size
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    vocab = rt.scheduler.engine.loaded.cfg.vocab_size
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt")
    max_tokens = body.max_tokens if body.max_tokens is not None else ctx - len(ids)
    if len(ids) + max(max_tokens, 1) > ctx:
        raise APIError(400, f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) is over the context "
                            f"of {ctx} positions: shorten the prompt or lower max_tokens",
                       param="max_tokens" if body.max_tokens is not None and len(ids) < ctx else "messages"
                       if hasattr(body, "messages") else "prompt", code="context_length_exceeded")
    try:
        sampling = body.sampling()
    except KvferryError as e:
        raise APIError(400, str(e)) from None
    return GenParams(list(ids), max_tokens, sampling, body.stops(), body.ignore_eos)


async def _generate(rt: Runtime, request: Request, body, ids: list[int], ans: Answer):
    params = _params(rt, body, ids)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()
    try:
        job = rt.scheduler.submit(params, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
    except QueueFull as e:
        rt.metrics.rejected.labels("429").inc()
        raise APIError(429, str(e), "rate_limit_error", code="queue_full") from None
    except NotAccepting as e:
        raise APIError(503, str(e), "unavailable", code="shutting_down") from None
    no_text = rt.tokenizer is None
    if body.stream:
        return StreamingResponse(_sse(rt, job, events, ans, body.include_usage, no_text),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await _collect(rt, request, job, events, ans, no_text)


async def _collect(rt, request: Request, job, events: asyncio.Queue, ans: Answer, no_text: bool):
    parts, token_ids = [], []
    try:
        while True:
            try:
                ev = await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    rt.scheduler.cancel(job)
                    return Response(status_code=499)
                continue
            if ev.kind == "text":
                parts.append(ev.text)
                token_ids += ev.token_ids
            elif ev.kind == "error":
                return _error(503 if "shut" in ev.text else 500, ev.text, "server_error")
            else:
                return ans.full("".join(parts), ev.finish_reason, usage(ev.prompt_tokens, ev.completion_tokens),
                                token_ids if no_text else None)
    except asyncio.CancelledError:
        rt.scheduler.cancel(job)
        raise


def _sse_line(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _sse(rt, job, events: asyncio.Queue, ans: Answer, include_usage: bool, no_text: bool):
    """SSE chunks until the request ends; a client that goes away cancels it (Starlette cancels
    this generator when the connection closes), which frees the slot at the next step."""
    done = False
    try:
        if ans.chat:
            yield _sse_line(ans.chunk(None, role=True, with_usage=include_usage))
        while True:
            ev = await events.get()
            if ev.kind == "text":
                if ev.text or ev.token_ids:
                    yield _sse_line(ans.chunk(ev.text, token_ids=ev.token_ids, with_usage=include_usage))
            elif ev.kind == "error":
                done = True
                yield _sse_line(error_body(ev.text, "server_error"))
                break
            else:
                done = True
                yield _sse_line(ans.chunk(None if ans.chat else "", ev.finish_reason, with_usage=include_usage))
                if include_usage:
                    yield _sse_line(ans.usage_chunk(usage(ev.prompt_tokens, ev.completion_tokens)))
                break
        yield "data: [DONE]\n\n"
    finally:
        if not done:
            rt.scheduler.cancel(job)
