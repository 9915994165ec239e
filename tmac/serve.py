"""``tmac serve``: an OpenAI-compatible HTTP API over one model (FastAPI on uvicorn), its generations batched
continuously (``tmac.models.batching``).

``POST /v1/chat/completions`` (the model's chat template), ``POST /v1/completions``, ``GET /v1/models`` and
``GET /health``; streamed as server-sent events ending ``data: [DONE]``, or whole. Bad requests get a 4xx with an
OpenAI-style error body; a full queue 503 with ``Retry-After``; with an API key, a request without
``Authorization: Bearer KEY`` 401. Sampling: ``temperature``, ``top_p``, ``seed``, ``stop``, ``presence_penalty``
and ``frequency_penalty``, and llama.cpp's server's ``top_k``, ``repeat_penalty`` and ``repeat_last_n``. Imported
only by the CLI: ``import tmac`` imports neither FastAPI nor TVM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import sys
import time
import uuid
from typing import Literal, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from .models.batching import Batcher, Busy
from .models.batching import Request as Generation
from .models.text import check_prompt_size

MAX_STOPS = 4  # as OpenAI's API
SWITCH_INTERVAL = 0.0005  # seconds: the interpreter's, while a server runs
TYPE_TAGS = {"int", "float", "str", "bool", "dict", "list", "literal"}  # pydantic's union branches in a location
Number = Union[StrictInt, StrictFloat]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    n: StrictInt = 1
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: dict | None = None
    user: StrictStr | None = None
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    # llama.cpp's server's sampling extensions (the openai client sends them in ``extra_body``)
    top_k: StrictInt = 0
    repeat_penalty: Number = 1.0
    repeat_last_n: StrictInt = 64


class CompletionBody(_Body):
    prompt: StrictStr | list[StrictStr]
    max_tokens: StrictInt | None = 16  # OpenAI's default for completions


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param, self.headers = \
            status, message, kind, code, param, headers


def _error(status: int, message: str, kind: str, code=None, param=None, headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status,
                        headers=headers)


def create_app(model, model_name: str, api_key: str | None = None, max_batch: int = 4, max_queue: int = 16) -> FastAPI:
    """The API over ``model`` (a loaded tmac model with its tokenizer), answering to ``model_name``."""
    batcher = Batcher(model, max_batch, max_queue)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # the batching thread keeps the GIL through a step's kernel calls; each time the event loop gives it up (a
        # socket write, a select) it waits a switch interval to get it back: at the default 5 ms it fell behind the
        # tokens and noticed a client gone only after hundreds of steps (docs/decisions.md, "switch interval")
        interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL)
        try:
            yield
        finally:
            sys.setswitchinterval(interval)
            batcher.close()

    app = FastAPI(title="tmac", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.batcher = batcher
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return _error(e.status, e.message, e.kind, e.code, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:] if str(x) not in TYPE_TAGS
                         and not str(x).startswith(("list[", "function-"))) or None
        return _error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", "invalid_request_error",
                      param=where)

    @app.exception_handler(404)
    async def _not_found(request, e):
        return _error(404, f"no route {request.method} {request.url.path}", "invalid_request_error")

    @app.exception_handler(405)
    async def _not_allowed(request, e):
        return _error(405, f"method {request.method} is not allowed on {request.url.path}", "invalid_request_error")

    if api_key is not None:
        app.add_middleware(_RequireKey, key=api_key)

    @app.get("/health")
    async def health():
        return {"status": "ok", **batcher.load()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(model_name, created)]}

    @app.get("/v1/models/{name}")
    async def one_model(name: str):
        _check_model(name, model_name)
        return _model_card(model_name, created)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise APIError(400, "prompt: one prompt per request (n = 1)", param="prompt")
            prompt = prompt[0]
        _check_model(body.model, model_name)
        check_prompt_size_or_400(model, len(prompt))
        ids = model.tokenizer.encode(prompt)
        return await _generate(request, body, ids, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        _check_model(body.model, model_name)
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
                    for m in body.messages]
        check_prompt_size_or_400(model, sum(len(m["content"]) for m in messages))
        try:
            ids = model.tokenizer.encode(model.tokenizer.render_chat(messages))
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await _generate(request, body, ids, limit, chat=True)

    async def _generate(http: Request, body: _Body, ids: list[int], max_tokens: int | None, chat: bool):
        if body.n != 1:
            raise APIError(400, "n: only n = 1 is served", param="n")
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if not body.repeat_penalty > 0:  # (the sampler's own message names it repetition_penalty)
            raise APIError(400, f"repeat_penalty must be > 0, got {body.repeat_penalty!r}", param="repeat_penalty")
        if len(stop) > MAX_STOPS:
            raise APIError(400, f"stop: at most {MAX_STOPS} strings", param="stop")
        if len(ids) >= model.context:
            raise APIError(400, f"the prompt ({len(ids)} tokens) leaves no room in the context of {model.context} "
                                f"tokens", code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = model.context - len(ids)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        def emit(piece: str, end: str | None) -> None:  # from the batching thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, (piece, end))
            except RuntimeError:  # the event loop is gone (the server stopping): nobody reads this any more
                generation.cancel()

        generation = Generation(ids, max_tokens, emit, temperature=float(body.temperature), top_p=float(body.top_p),
                                top_k=body.top_k, repetition_penalty=float(body.repeat_penalty),
                                repeat_last_n=body.repeat_last_n, presence_penalty=float(body.presence_penalty),
                                frequency_penalty=float(body.frequency_penalty), seed=body.seed, stop=tuple(stop))
        try:
            batcher.submit(generation)
        except Busy as e:
            raise APIError(503, f"the server is busy ({e}); try again shortly", "server_error", "busy",
                           headers={"Retry-After": "1"}) from None
        except (ValueError, TypeError) as e:
            code = "context_length_exceeded" if "context" in str(e) else None
            raise APIError(400, str(e), code=code) from None
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        meta = dict(id=ident, created=int(time.time()), model=model_name)
        usage = lambda: {"prompt_tokens": len(ids), "completion_tokens": len(generation.ids),  # noqa: E731
                         "total_tokens": len(ids) + len(generation.ids),
                         "prompt_tokens_details": {"cached_tokens": generation.cached}}
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(_stream(generation, events, meta, chat, usage, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text, finish = [], None
        try:
            while finish is None:
                try:
                    piece, finish = await asyncio.wait_for(events.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        generation.cancel()
                        return JSONResponse({}, 499)
                    continue
                text.append(piece)
        finally:
            if finish is None:
                generation.cancel()
        if finish == "error":
            raise APIError(500, "".join(text), "server_error")
        content = "".join(text)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": content, "finish_reason": finish, "logprobs": None}
        return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                "usage": usage()}

    return app


async def _stream(generation, events: asyncio.Queue, meta: dict, chat: bool, usage, include_usage: bool):
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(piece: str | None, finish: str | None, first: bool = False) -> str:
        if chat:
            delta = ({"role": "assistant"} if first else {}) | ({"content": piece} if piece else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": None}
        body = {**meta, "object": kind, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    finish = None
    try:
        if chat:
            yield chunk("", None, first=True)
        while finish is None:
            piece, finish = await events.get()
            if finish == "error":
                yield f"data: {json.dumps({'error': {'message': piece, 'type': 'server_error'}})}\n\n"
                break
            if piece or finish:
                yield chunk(piece, finish)
        if include_usage and finish != "error":
            yield f"data: {json.dumps({**meta, 'object': kind, 'choices': [], 'usage': usage()})}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # a client gone mid-stream: its sequence leaves the batch at the next step
        if finish is None:
            generation.cancel()


class _RequireKey:
    """401 for a ``/v1/`` request without ``Authorization: Bearer KEY``. A plain ASGI middleware: Starlette's
    ``BaseHTTPMiddleware`` passes every streamed piece through a task of its own, Python work that holds the GIL the
    batching thread needs (docs/decisions.md, "The API key is checked by a plain ASGI middleware")."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token, self.key):
                response = _error(401, "a valid API key is needed: Authorization: Bearer KEY",
                                  "invalid_request_error", "invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "tmac"}


def _check_model(name: str, served: str) -> None:
    if name != served:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {served!r}", code="model_not_found",
                       param="model")


def check_prompt_size_or_400(model, chars: int) -> None:
    try:
        check_prompt_size(model.tokenizer, chars, model.context)
    except ValueError as e:
        raise APIError(400, str(e), code="context_length_exceeded") from None


def model_name(path: str) -> str:
    """What the API calls a model: its file name without the extension, or its directory's name."""
    base = os.path.basename(os.path.normpath(path))
    return base.removesuffix(".gguf").removesuffix(".tmac") or base
