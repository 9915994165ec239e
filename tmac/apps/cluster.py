"""``tmac serve`` on Ray Serve: replicas of the same OpenAI-compatible app, each with its own model and batcher,
behind a thin ingress that sends each conversation to the replica holding its prefix.

- ``Replica``: loads the model and builds ``tmac.apps.serve.create_app`` — the API, its bodies and errors, written once
  — and runs each forwarded request through it as an ASGI call, streaming its messages back. Ray Serve restarts
  one whose process dies or whose health check (a one-token generation through its batcher) fails.
- ``Ingress``: reads a request (bounded as ``tmac serve`` bounds it), forwards it whole to a replica and relays the
  answer. A replica that dies before its answer started is retried on another; one that dies mid-stream ends the
  stream with an error event saying to retry.
- ``PrefixAffinityRouter``: Serve's request router for the replicas, ranking them by rendezvous hash of the
  conversation's start (its messages up to the first user message, or a prompt's first characters): every turn of a
  conversation reaches the replica whose KV cache holds its prefix while that replica is alive and not full; a
  replaced replica moves only its own conversations.

Run: ``tmac serve --ray --replicas N`` (a local Ray cluster, or the one ``RAY_ADDRESS`` names), or ``serve run
tmac.apps.cluster:build model=ORG/NAME replicas=2`` (docs/cluster.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import sys

from ray import serve
from ray.serve.request_router import RequestRouter

from tmac.apps.serve import MAX_BODY

AFFINITY_CHARS = 1024  # of a conversation's start: enough to tell conversations apart, short to hash
RETRIES = 2  # other replicas tried for a request whose replica died before answering
APP_NAME = "tmac"


@dataclasses.dataclass
class Forwarded:
    """One HTTP request, whole, as the ingress hands it to a replica."""

    method: str
    path: str
    query: bytes
    headers: list
    body: bytes
    client: tuple | None
    affinity: str = ""  # what the router hashes


def affinity_key(body: bytes) -> str:
    """The start of the conversation a request continues: its messages up to the first user message (a chat), or
    its prompt's first characters (a completion); "" where the body says neither."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(data, dict):
        return ""
    messages, prompt = data.get("messages"), data.get("prompt")
    if isinstance(messages, list):
        start = []
        for m in messages:
            start.append(m)
            if isinstance(m, dict) and m.get("role") == "user":
                break
        return json.dumps(start, sort_keys=True)[:AFFINITY_CHARS]
    if isinstance(prompt, str):
        return prompt[:AFFINITY_CHARS]
    return ""


def rendezvous(key: str, replica_ids: list[str]) -> list[str]:
    """``replica_ids`` ranked for ``key`` by highest random weight: the first is the key's home; removing a replica
    moves only the keys whose home it was."""
    return sorted(replica_ids, key=lambda r: hashlib.blake2b(f"{r}\0{key}".encode(), digest_size=8).digest(),
                  reverse=True)


class PrefixAffinityRouter(RequestRouter):
    """Serve's request router for ``Replica``: a conversation's home replica first, then the others (Serve takes
    the first rank with room, by queue length) — unless the home has ``imbalance`` or more requests in flight beyond
    the least loaded replica (a conversation's cached prefix is worth less than a batch that much wider), or the
    request has no conversation: then the least loaded."""

    imbalance = 2

    def initialize_state(self, imbalance: int = 2, **kwargs):
        self.imbalance = imbalance

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        key = ""
        if pending_request is not None and pending_request.args:
            key = getattr(pending_request.args[0], "affinity", "") or ""
        if not key or len(candidate_replicas) < 2:
            return [list(candidate_replicas)]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranked = [by_id[i] for i in rendezvous(key, list(by_id))]
        loads = [self.replica_queue_len_cache.get(r.replica_id) for r in ranked]
        if loads[0] is not None and loads[0] - min(n for n in loads if n is not None) >= self.imbalance:
            return [ranked]
        return [[ranked[0]], ranked[1:]]


class Replica:
    """One model, its batcher and the API over it."""

    def __init__(self, model: str | None, threads: int, context: int | None, max_batch: int, max_queue: int,
                 alias: str | None, api_key: str | None, mmap: bool = True):
        import tmac

        from tmac.apps.process import own_torch_threads
        from tmac.apps.serve import SWITCH_INTERVAL, Served, create_app, model_name

        tmac.set_num_threads(threads)
        loaded = tmac.load_model(model, context=context, mmap=mmap)  # (create_app refuses one with no tokenizer)
        own_torch_threads(loaded)  # (a replica owns its worker process)
        served = Served(alias or model_name(loaded.source), model, os.path.basename(loaded.source),
                        model_name(loaded.source))
        self.app = create_app(loaded, served, api_key, max_batch, max_queue, log=None)
        self.model = loaded
        sys.setswitchinterval(SWITCH_INTERVAL)  # (the app's lifespan does this under uvicorn)
        self.replica = serve.get_replica_context().replica_id.unique_id

    def identity(self) -> tuple[str, int]:
        """This replica's id and process id."""
        return self.replica, os.getpid()

    async def forward(self, request: Forwarded):
        """The ASGI messages of ``request``'s answer, as the app sends them; a first ``tmac.replica`` message
        names this replica. Closing the generator (the client left) is the app's disconnect."""
        yield {"type": "tmac.replica", "replica": self.replica}
        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        sent_body = False

        async def receive():
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            await messages.put(message)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": request.method, "scheme": "http", "path": request.path,
                 "raw_path": request.path.encode(), "query_string": request.query, "root_path": "",
                 "headers": request.headers, "client": request.client, "server": None, "state": {}}
        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    break
            await task
        finally:
            gone.set()
            if not task.done():
                try:
                    await asyncio.wait_for(task, 5)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    task.cancel()

    async def check_health(self) -> None:
        """A one-token greedy generation through the batcher, as a request would run: raises where the model or
        its batching thread cannot answer (Serve then replaces this replica). A full queue is a busy replica, not a
        sick one."""
        from tmac.models.run.batching import Busy, Request
        from tmac.models.run.sampling import SamplingParams

        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def emit(piece, finish, logprobs=()):
            if finish is not None and not done.done():
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(finish))

        ids = self.model.tokenizer.encode("ok")[:1] or [0]
        try:
            self.app.state.batcher.submit(Request(ids, SamplingParams(max_tokens=1, temperature=0), emit))
        except Busy:
            return
        finish = await asyncio.wait_for(done, 25)
        if finish not in ("stop", "length"):
            raise RuntimeError(f"the health check's generation ended with {finish!r}")

    def __del__(self):
        app = getattr(self, "app", None)
        if app is not None:
            app.state.batcher.close()


class Ingress:
    """The HTTP side: each request read whole (at most ``max_body`` bytes), forwarded, its answer relayed."""

    def __init__(self, replicas, max_body: int):
        from tmac.apps.serve import _LimitBody

        self.replicas = replicas.options(stream=True)
        self.asgi = _LimitBody(self._forward, max_body)

    def __serve_build_asgi_app__(self):
        return self.asgi

    async def _forward(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = Forwarded(scope["method"], scope["path"], scope.get("query_string", b""),
                            [(k, v) for k, v in scope["headers"] if k != b"host"], bytes(body),
                            tuple(scope["client"]) if scope.get("client") else None, affinity_key(bytes(body)))
        for attempt in range(RETRIES + 1):
            started, replica, streamed = False, None, False
            try:
                async for message in self.replicas.forward.remote(request):
                    if message["type"] == "tmac.replica":
                        replica = message["replica"]
                        continue
                    if message["type"] == "http.response.start":
                        started = True
                        headers = list(message.get("headers", []))
                        streamed = any(k == b"content-type" and v.startswith(b"text/event-stream")
                                       for k, v in headers)
                        message = {**message, "headers": headers + [(b"x-tmac-replica", str(replica).encode())]}
                    await send(message)
                return
            except Exception as e:  # noqa: BLE001  (a replica's death arrives as any of Ray's error types)
                if not _replica_gone(e):
                    raise
                if started:
                    await _end_broken(send, streamed)
                    return
                if attempt == RETRIES:
                    await _unavailable(scope, receive, send)
                    return
                await asyncio.sleep(0.25 * (attempt + 1))  # (Serve's router hears of the death meanwhile)


def _replica_gone(e: Exception) -> bool:
    from ray import exceptions

    return isinstance(e, (exceptions.RayActorError, exceptions.ActorUnavailableError)) or \
        type(e).__name__ in ("ActorDiedError", "ActorUnavailableError", "RayActorError")


async def _end_broken(send, streamed: bool) -> None:
    """The end of an answer whose replica died while it was sent: a stream gets an error event saying to retry."""
    if streamed:
        error = {"error": {"message": "the replica serving this request stopped; send it again", "type":
                           "server_error", "param": None, "code": "replica_unavailable"}}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(error)}\n\n".encode(),
                    "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _unavailable(scope, receive, send) -> None:
    from tmac.apps.serve import _error

    response = _error(503, "no replica could answer this request now; send it again shortly", "server_error",
                      "replica_unavailable", headers={"Retry-After": "1"})
    await response(scope, receive, send)


def deployment(model: str | None = None, replicas: int = 1, threads: int = 1, context: int | None = None,
               max_batch: int = 4, max_queue: int = 16, alias: str | None = None, api_key: str | None = None,
               max_body: int = MAX_BODY, min_replicas: int | None = None, max_replicas: int | None = None,
               mmap: bool = True):
    """The Serve application: ``replicas`` of ``Replica`` (``threads`` CPUs each; with ``min_replicas`` /
    ``max_replicas``, autoscaled between them on requests in flight per replica against ``max_batch``) behind
    one ``Ingress``."""
    from ray.serve.config import RequestRouterConfig

    options = replica_options(replicas, threads, max_batch, max_queue, min_replicas, max_replicas)
    replica = serve.deployment(
        Replica, name="Replica", request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRouter, request_router_kwargs={"imbalance": max(2, max_batch // 2)}),
        **options)
    ingress = serve.deployment(serve.ingress()(Ingress), name="Ingress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=10_000)
    return ingress.bind(replica.bind(model, threads, context, max_batch, max_queue, alias, api_key, mmap), max_body)


def replica_options(replicas: int, threads: int, max_batch: int, max_queue: int, min_replicas: int | None,
                    max_replicas: int | None) -> dict:
    """Serve's options for the replicas: their CPUs, requests in flight, health check, and a fixed count or
    autoscaling bounds (on requests in flight per replica, against ``max_batch``)."""
    if replicas < 1 or threads < 1:
        raise ValueError(f"--replicas and --threads must be at least 1, got {replicas} and {threads}")
    options = {"ray_actor_options": {"num_cpus": threads}, "max_ongoing_requests": max_batch + max_queue,
               "health_check_period_s": 10, "health_check_timeout_s": 30}
    if min_replicas is None and max_replicas is None:
        return {**options, "num_replicas": replicas}
    low = min_replicas if min_replicas is not None else 1
    high = max_replicas if max_replicas is not None else max(low, replicas)
    if not 1 <= low <= high:
        raise ValueError(f"--min-replicas {low} and --max-replicas {high}: need 1 <= min <= max")
    return {**options, "autoscaling_config": {"min_replicas": low, "max_replicas": high, "initial_replicas":
                                              min(max(replicas, low), high), "target_ongoing_requests": max_batch}}


_NUMBERS = {"replicas", "threads", "context", "max_batch", "max_queue", "max_body", "min_replicas", "max_replicas"}


def build(args: dict):
    """``serve run tmac.apps.cluster:build model=ORG/NAME replicas=2 threads=1`` (and a RayService's ``args``): the
    keyword arguments of ``deployment``, as text."""
    options = {k.replace("-", "_"): v for k, v in args.items()}
    unknown = set(options) - _NUMBERS - {"model", "alias", "api_key", "mmap"}
    if unknown:
        raise ValueError(f"tmac.apps.cluster:build does not take {', '.join(sorted(unknown))}")
    for k in _NUMBERS & set(options):
        options[k] = int(options[k])
    if "mmap" in options:
        options["mmap"] = str(options["mmap"]).lower() not in ("0", "false", "no")
    return deployment(**options)
