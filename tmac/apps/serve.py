"""``tmac serve``: an OpenAI-compatible HTTP API over one model (FastAPI on uvicorn), its generations batched
continuously (``tmac.models.run.batching``).

``POST /v1/chat/completions`` (the model's chat template), ``POST /v1/completions``, ``GET /v1/models``, and
llama.cpp's server's ``/health``, ``/props``, ``/metrics`` (Prometheus), ``/tokenize``, ``/detokenize``; streamed
as server-sent events ending ``data: [DONE]``, or whole. Sampling: every ``SamplingParams`` option by its name or
alias (OpenAI's fields, llama.cpp's ``top_k``, ``min_p``, ``repeat_penalty`` …), its defaults where a field is
absent. A field that does not change the answer and is not served (``store``, ``metadata``, ``tools`` …) is
ignored, said once in the log; one that would (``n`` > 1, a JSON ``response_format``) is a 400. Bad requests get a
4xx with an OpenAI-style error body; a full queue 503 with ``Retry-After``; with an API key, a request without
``Authorization: Bearer KEY`` 401. One line is logged a request. Imported only by the CLI: ``import tmac``
imports neither FastAPI nor TVM.
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

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from tmac.models.run.batching import Batcher, Busy
from tmac.models.run.batching import Request as Generation
from tmac.models.run.sampling import ALIASES, OPTIONS, SamplingError, SamplingParams
from tmac.models.text.stream import check_prompt_size
from tmac.apps.serve_http import check_api_key

MAX_STOPS = 4  # as OpenAI's API
SWITCH_INTERVAL = 0.0005  # seconds: the interpreter's, while a server runs
MAX_TOP_LOGPROBS = {"chat": 20, "completions": 5}  # OpenAI's bounds
ROLES = ("system", "developer", "user", "assistant")


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param, self.headers = \
            status, message, kind, code, param, headers


def _error(status: int, message: str, kind: str, code=None, param=None, headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status,
                        headers=headers)


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def log_line(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


class Served:
    """What the API calls the model: ``name`` (``--alias``, else the file's stem), and the other names a request
    may give for it (what it was started with, the file's name). Any name is answered, as llama.cpp's server does
    with its one model; the answers carry ``name``."""

    def __init__(self, name: str, *others: str):
        self.name = name
        self.names = list(dict.fromkeys(n for n in (name, *others) if n))


MAX_BODY = 8 << 20  # bytes of a request body, by default: a long conversation is well under a MiB


def create_app(model, model_name: str | Served, api_key: str | None = None, max_batch: int = 4,
               max_queue: int = 16, log=log_line, max_body: int = MAX_BODY) -> FastAPI:
    """The API over ``model`` (a loaded tmac model with its tokenizer), answering to ``model_name``; ``log``: where
    the per-request lines and notices go (None: nowhere); ``max_body``: the largest request body, in bytes."""
    served = model_name if isinstance(model_name, Served) else Served(model_name)
    check_api_key(api_key)
    batcher = Batcher(model, max_batch, max_queue)
    log = log or (lambda text: None)
    counters = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "errors": 0}
    said: set[str] = set()

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

    def ignore(fields) -> None:
        new = sorted(set(fields) - said)
        if new:
            said.update(new)
            log(f"ignoring request field{'s' if len(new) > 1 else ''} {', '.join(new)}: not served, and the "
                f"answer does not depend on {'them' if len(new) > 1 else 'it'} (said once)")

    paths = sorted({p for p in (str(model.source), os.path.dirname(str(model.source)),
                                os.path.realpath(str(model.source))) if len(p) > 1}, key=len, reverse=True)

    def redact(text: str) -> str:
        """An error's words without the model's place on this machine: the API names models, never paths."""
        for p in paths:
            text = text.replace(p, served.name)
        return text

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return _error(e.status, redact(e.message), e.kind, e.code, e.param, e.headers)

    @app.exception_handler(404)
    async def _not_found(request, e):
        return _error(404, f"no route {request.method} {request.url.path}", "invalid_request_error")

    @app.exception_handler(405)
    async def _not_allowed(request, e):
        return _error(405, f"method {request.method} is not allowed on {request.url.path}", "invalid_request_error")

    if api_key is not None:
        app.add_middleware(_RequireKey, key=api_key)
    app.add_middleware(_LimitBody, limit=max_body)
    app.add_middleware(_LogRequests, log=log)

    @app.get("/")
    async def root():
        return {"name": "tmac", "model": served.name, "api": "/v1 (OpenAI)",
                "endpoints": ["/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/props",
                              "/metrics", "/tokenize", "/detokenize"]}

    @app.get("/health")
    async def health():
        return {"status": "ok", **batcher.load()}

    @app.get("/props")
    async def props():
        return {"model": served.name, "model_names": served.names, "n_ctx": model.context,
                "total_slots": batcher.max_batch, "max_queue": batcher.max_queue,
                "default_generation_settings": {**SamplingParams().to_dict(), "n_ctx": model.context},
                "chat_template": model.tokenizer.chat_template or "", "build_info": f"tmac {_version()}"}

    @app.get("/metrics")
    async def metrics():
        load = batcher.load()
        rows = [("requests_total", "counter", "requests answered", counters["requests"]),
                ("request_errors_total", "counter", "requests that failed", counters["errors"]),
                ("prompt_tokens_total", "counter", "prompt tokens of the requests", counters["prompt_tokens"]),
                ("tokens_predicted_total", "counter", "tokens generated", counters["generated_tokens"]),
                ("prompt_tokens_prefilled_total", "counter", "prompt tokens fed", load["prefilled"]),
                ("prompt_tokens_reused_total", "counter", "prompt tokens found in kept caches", load["reused"]),
                ("decode_steps_total", "counter", "batched decode steps", load["steps"]),
                ("decode_tokens_total", "counter", "tokens the decode steps fed", load["stepped"]),
                ("decode_seconds_total", "counter", "seconds in decode steps", load["step_seconds"]),
                ("requests_processing", "gauge", "requests running or prefilling",
                 load["running"] + load["prefilling"]),
                ("requests_deferred", "gauge", "requests waiting", load["waiting"]),
                ("slots", "gauge", "requests generated together at most", load["max_batch"])]
        text = "".join(f"# HELP tmac_{n} {h}\n# TYPE tmac_{n} {t}\ntmac_{n} {v}\n" for n, t, h, v in rows)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _json(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise bad("content: a string to tokenize is needed", "content")
        check_prompt_size_or_400(model, len(content))
        add_special = body.get("add_special", False)
        if type(add_special) is not bool:
            raise bad("add_special must be true or false", "add_special")
        ids = model.tokenizer.encode(content, add_bos=add_special)
        if body.get("with_pieces"):
            return {"tokens": [{"id": i, "piece": model.tokenizer.decode([i])} for i in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _json(request)
        ids = body.get("tokens")
        vocab = model.config.vocab_size
        if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < vocab for i in ids):
            raise bad(f"tokens: a list of token ids in [0, {vocab}) is needed", "tokens")
        return {"content": model.tokenizer.decode(ids)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(served.name, created)]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str):
        if name not in served.names:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served.name!r}",
                           code="model_not_found", param="model")
        return _model_card(served.name, created)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(type(i) is int for i in prompt):
            ids = prompt  # token ids, as OpenAI's API allows
        elif isinstance(prompt, str):
            check_prompt_size_or_400(model, len(prompt))
            ids = model.tokenizer.encode(prompt)
        elif isinstance(prompt, list):
            raise bad("prompt: one prompt per request (n = 1)", "prompt")
        else:
            raise bad("prompt: a string (or a list of token ids) is needed", "prompt")
        top = body.get("logprobs")
        if top is not None and (type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS["completions"]):
            raise bad(f"logprobs must be an int in [0, {MAX_TOP_LOGPROBS['completions']}] or null", "logprobs")
        echo = body.get("echo", False)
        if type(echo) is not bool:
            raise bad("echo must be true or false", "echo")
        params = _params(body, {"prompt", "logprobs", "echo"}, top)
        prefix = (prompt if isinstance(prompt, str) else model.tokenizer.decode(ids)) if echo else ""
        return await _generate(request, body, ids, params, chat=False, prefix=prefix)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _json(request)
        messages = _messages(body.get("messages"))
        check_prompt_size_or_400(model, sum(len(m["content"]) for m in messages))
        try:
            ids = await asyncio.to_thread(lambda: model.tokenizer.encode(model.tokenizer.render_chat(messages)))
        except ValueError as e:
            raise bad(str(e), "messages") from None
        logprobs, top = body.get("logprobs", False), body.get("top_logprobs")
        if logprobs is not None and type(logprobs) is not bool:
            raise bad("logprobs must be true or false (top_logprobs says how many alternatives)", "logprobs")
        if top is not None and (type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS["chat"]):
            raise bad(f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS['chat']}]", "top_logprobs")
        if top and not logprobs:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        if body.get("max_completion_tokens") is not None:
            if body.get("max_tokens") is not None:
                raise bad("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
            body = {**body, "max_tokens": body["max_completion_tokens"]}
        _check_format(body)
        params = _params(body, {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "response_format"},
                         (top or 0) if logprobs else None)
        return await _generate(request, body, ids, params, chat=True)

    def _params(body: dict, read: set, logprobs: int | None) -> SamplingParams:
        """The body's sampling options (by name or alias) as ``SamplingParams``; the fields nobody reads are
        ignored (said once) or refused."""
        options, unknown = {}, []
        for key, value in body.items():
            name = ALIASES.get(key, key)
            if name in OPTIONS and name != "logprobs":
                if value is not None or name in ("seed", "max_tokens"):
                    options[key] = value
            elif key not in read and key not in ("model", "stream", "n", "stream_options"):
                unknown.append(key)
        ignore(unknown)
        n = body.get("n", 1)
        if n is not None and n != 1:
            raise bad("n: only n = 1 is served (send the request n times)", "n")
        stop = options.get("stop")
        if isinstance(stop, list) and len(stop) > MAX_STOPS:
            raise bad(f"stop: at most {MAX_STOPS} strings", "stop")
        if type(body.get("stream", False)) is not bool:
            raise bad("stream must be true or false", "stream")
        try:
            params = SamplingParams.make(**options, logprobs=logprobs)
        except SamplingError as e:
            raise bad(str(e), e.option) from None
        except TypeError as e:
            raise bad(str(e)) from None
        if params.max_tokens is not None and params.max_tokens < 1:
            raise bad(f"max_tokens must be an int of at least 1, got {params.max_tokens}", "max_tokens")
        return params

    async def _generate(http: Request, body: dict, ids: list[int], params: SamplingParams, chat: bool,
                        prefix: str = ""):
        if len(ids) >= model.context:
            raise APIError(400, f"the prompt ({len(ids)} tokens) leaves no room in the context of {model.context} "
                                f"tokens", code="context_length_exceeded")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(piece: str, end: str | None, logprobs: list) -> None:  # from the batching thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, (piece, end, logprobs))
            except RuntimeError:  # the event loop is gone (the server stopping): nobody reads this any more
                generation.cancel()

        generation = Generation(ids, params, emit)
        try:
            batcher.submit(generation)
        except Busy as e:
            raise APIError(503, f"the server is busy ({e}); try again shortly", "server_error", "busy",
                           headers={"Retry-After": "1"}) from None
        except SamplingError as e:
            raise bad(str(e), e.option) from None
        except (ValueError, TypeError) as e:
            code = "context_length_exceeded" if "context" in str(e) else None
            raise APIError(400, str(e), code=code) from None
        except RuntimeError as e:  # closed: shutting down
            raise APIError(503, str(e), "server_error", "shutting_down") from None
        started = time.perf_counter()
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        meta = dict(id=ident, created=int(time.time()), model=served.name)
        usage = lambda: {"prompt_tokens": len(ids), "completion_tokens": len(generation.ids),  # noqa: E731
                         "total_tokens": len(ids) + len(generation.ids),
                         "prompt_tokens_details": {"cached_tokens": generation.cached}}
        lp = _Logprobs(model.tokenizer, chat) if params.logprobs is not None else None
        http.state.tmac = stats = {"prompt": len(ids), "cached": 0, "generated": 0, "started": started}
        watcher = asyncio.ensure_future(_watch_disconnect(http, generation, events))

        def account(finish):
            stats.update(cached=generation.cached, generated=len(generation.ids), finish=finish)
            counters["requests"] += 1
            counters["prompt_tokens"] += len(ids)
            counters["generated_tokens"] += len(generation.ids)
            counters["errors"] += finish == "error"

        def failed(piece: str, finish: str) -> APIError:
            if finish == "busy":
                return APIError(503, f"the server is busy: {piece}; try again shortly", "server_error", "busy",
                                headers={"Retry-After": "1"})
            return APIError(500, redact(piece), "server_error")

        stream = bool(body.get("stream"))
        text, finish, entries, streaming = [prefix], None, [], False
        try:
            while finish is None:
                event = await events.get()
                if event is None:  # the client left
                    return JSONResponse({}, 499)
                piece, finish, logprobs = event
                if finish in ("busy", "error"):  # (a stream's status waits for its first event: a 503 or 500,
                    raise failed(piece, finish)  # never a 200 that carries an error)
                if stream:
                    streaming = True
                    break
                text.append(piece)
                entries += logprobs
        finally:
            if not streaming:  # (a stream's end is its own)
                watcher.cancel()
                if finish is None:
                    generation.cancel()
                account(finish)
        if stream:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage")) \
                if isinstance(body.get("stream_options"), dict) else False
            return StreamingResponse(_stream(generation, events, event, meta, chat, usage, include_usage, lp, prefix,
                                             account, watcher, redact),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        content = "".join(text)
        choice = {"index": 0, "finish_reason": finish,
                  "logprobs": lp.whole(entries, len(prefix)) if lp is not None else None}
        if chat:
            choice["message"] = {"role": "assistant", "content": content}
        else:
            choice["text"] = content
        return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                "usage": usage()}

    app.state.shutdown = batcher.shutdown
    return app


async def _json(request: Request) -> dict:
    """The request's body as a JSON object of valid Unicode, or a 400 in OpenAI's shape; parsed off the event loop
    (a large body does not stall the other clients' streams)."""
    raw = await request.body()
    try:
        body = await asyncio.to_thread(json.loads, raw)
    except (ValueError, RecursionError) as e:
        raise bad(f"the body is not valid JSON ({str(e)[:120]})") from None
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    where = await asyncio.to_thread(_lone_surrogate, body)
    if where is not None:
        raise bad(f"{where or 'body'}: not valid Unicode (a lone surrogate: half of a UTF-16 pair)", where or None)
    return body


def _lone_surrogate(value, where: str = "") -> str | None:
    """Where in ``value`` a string holds a lone surrogate (JSON's "\\ud800"), which no text can encode; None if
    nowhere."""
    stack = [(value, where)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return at
        elif isinstance(v, dict):
            stack += [(x, f"{at}.{k}" if at else str(k)) for k, x in v.items()]
        elif isinstance(v, list):
            stack += [(x, f"{at}.{i}" if at else str(i)) for i, x in enumerate(v)]
    return None


def _messages(messages) -> list[dict]:
    """The chat's messages as the template takes them: text content (a string, or its text parts), OpenAI's extra
    keys (``refusal``, ``tool_calls``, ``name`` …) ignored."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages: a non-empty list of messages is needed", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise bad(f"{where}: a message is an object with role and content", where)
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise bad(f"{where}.role: {role!r:.40} is not one of {', '.join(ROLES)}", f"{where}.role")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                if not isinstance(p, dict) or p.get("type") not in ("text", "input_text") or \
                        not isinstance(p.get("text"), str):
                    kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                    raise bad(f"{where}.content.{j}: only text parts are served, got {kind!r:.40}",
                              f"{where}.content")
                parts.append(p["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise bad(f"{where}.content: a string or a list of text parts is needed", f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _check_format(body: dict) -> None:
    """Refuse what would change the answer and is not served: a JSON response format, a required tool call."""
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad("response_format: only {\"type\": \"text\"} is served (no constrained JSON output)",
                  "response_format")
    choice = body.get("tool_choice")
    if choice not in (None, "none", "auto"):
        raise bad("tool_choice: tools are not called by this server (only \"none\" or \"auto\", which answer in "
                  "text)", "tool_choice")


async def _watch_disconnect(http: Request, generation, events: asyncio.Queue) -> None:
    """Cancel ``generation`` when its client hangs up (the body is read: the next message is the disconnect)."""
    with contextlib.suppress(Exception):
        while True:
            message = await http.receive()
            if message["type"] == "http.disconnect":
                generation.cancel()
                events.put_nowait(None)
                return


class _Logprobs:
    """Token log-probabilities in OpenAI's shapes: chat's ``content`` list, completions' parallel arrays."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _entry(self, token: int, logprob: float) -> dict:
        piece = self._piece(token)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8", "surrogatepass"))}

    def chunk(self, entries: list) -> dict | None:
        if not entries:
            return None
        if self.chat:
            return {"content": [{**self._entry(e.token, e.logprob),
                                 "top_logprobs": [self._entry(t, v) for t, v in e.top]} for e in entries]}
        return self.whole(entries, 0)

    def whole(self, entries: list, offset: int) -> dict:
        if self.chat:
            return self.chunk(entries) or {"content": []}
        tokens = [self._piece(e.token) for e in entries]
        offsets, at = [], offset
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._piece(t): v for t, v in e.top} for e in entries], "text_offset": offsets}


async def _stream(generation, events: asyncio.Queue, first: tuple, meta: dict, chat: bool, usage, include_usage: bool,
                  lp, prefix: str, account, watcher, redact):
    """The stream's events as server-sent events, ``first`` (the generation's first, already taken) and the rest."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(piece: str | None, finish: str | None, entries=(), opening: bool = False) -> str:
        logprobs = lp.chunk(list(entries)) if lp is not None else None
        if chat:
            delta = ({"role": "assistant"} if opening else {}) | ({"content": piece} if piece else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": logprobs}
        body = {**meta, "object": kind, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    finish = None
    try:
        if chat:
            yield chunk("", None, opening=True)
        elif prefix:
            yield chunk(prefix, None)
        event = first
        while finish is None:
            if event is None:
                event = await events.get()
                if event is None:  # the client left
                    return
            (piece, finish, entries), event = event, None
            if finish in ("error", "busy"):
                yield f"data: {json.dumps({'error': {'message': redact(piece), 'type': 'server_error'}})}\n\n"
                break
            if piece or finish or entries:
                yield chunk(piece, finish, entries)
        if include_usage and finish not in ("error", "busy"):
            yield f"data: {json.dumps({**meta, 'object': kind, 'choices': [], 'usage': usage()})}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # a client gone mid-stream: its sequence leaves the batch at the next step
        watcher.cancel()
        if finish is None:
            generation.cancel()
        account(finish)


class _RequireKey:
    """401 for a request without ``Authorization: Bearer KEY`` (all but ``/`` and ``/health``, which monitors ask
    without one). A plain ASGI middleware: Starlette's ``BaseHTTPMiddleware`` passes every streamed piece through a
    task of its own, Python work that holds the GIL the batching thread needs (docs/decisions.md, "The API key is
    checked by a plain ASGI middleware")."""

    OPEN = ("/", "/health")

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.OPEN:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                response = _error(401, "a valid API key is needed: Authorization: Bearer KEY",
                                  "invalid_request_error", "invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _LimitBody:
    """413 for a request body past ``limit`` bytes: by its Content-Length at once, else (chunked) as it arrives,
    before more of it is held in memory."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        too_large = _error(413, f"the request body is larger than {self.limit} bytes (--max-body)",
                           "invalid_request_error", "request_too_large")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await too_large(scope, receive, send)
        seen, started = [0], [False]

        async def counting():
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.limit:
                    raise _TooLarge
            return message

        async def sending(message):
            started[0] = started[0] or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting, sending)
        except _TooLarge:
            if not started[0]:
                await too_large(scope, receive, send)


class _TooLarge(Exception):
    pass


class _LogRequests:
    """One line a request once its answer is sent, as llama.cpp's server logs: method, path, status, and for a
    generation its prompt (cached) and generated tokens and speed."""

    def __init__(self, app, log):
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [0]
        started = time.perf_counter()

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            line = f"{scope['method']} {scope['path']} {status[0] or '-'}"
            stats = scope.get("state", {}).get("tmac")
            if stats:
                seconds = time.perf_counter() - stats["started"]
                rate = stats["generated"] / seconds if seconds > 0 else 0.0
                line += (f" | prompt {stats['prompt']} tokens ({stats['cached']} cached) | generated "
                         f"{stats['generated']} in {seconds:.2f} s ({rate:.1f} tok/s)"
                         + (f" | {stats['finish']}" if stats.get("finish") else " | client left"))
            else:
                line += f" | {(time.perf_counter() - started) * 1e3:.1f} ms"
            self.log(line)


def _model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "tmac"}


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("tmac")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def check_prompt_size_or_400(model, chars: int) -> None:
    try:
        check_prompt_size(model.tokenizer, chars, model.context)
    except ValueError as e:
        raise APIError(400, str(e), code="context_length_exceeded") from None


def model_name(path: str) -> str:
    """What the API calls a model: its file name without the extension, or its directory's name."""
    base = os.path.basename(os.path.normpath(path))
    return base.removesuffix(".gguf").removesuffix(".tmac") or base

