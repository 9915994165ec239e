"""``tmac serve`` under abuse, on loopback: clients that dribble their headers or body are answered 408 and dropped
after ``--request-timeout`` while others are served; connections past ``--max-connections`` get 503 at once;
pipelined requests with and without the API key each get their own status; two hundred concurrent completions
each end in a whole answer or an error status in OpenAI's shape (a stream's status waits for its admission, so no
200 ever carries an error)."""
import json
import socket
import threading
import time

import pytest
from conftest import smollm2_path
from test_serve import call, serving

import tmac


@pytest.fixture(scope="module")
def model():
    return tmac.load_model(smollm2_path(), context=512, progress=False)


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _read_all(s: socket.socket) -> bytes:
    """What the server sends until it closes the connection (b"" + the time it took are the caller's)."""
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    return got


def _dribble(s: socket.socket, data: bytes, every: float, stop: threading.Event) -> None:
    for byte in data:
        if stop.is_set():
            return
        try:
            s.sendall(bytes([byte]))
        except OSError:  # closed by the server: what the test waits for
            return
        time.sleep(every)


def _openai_error(raw: bytes, status: int) -> dict:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), raw[:200]
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def test_slow_clients_are_dropped_and_others_served(model):
    body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    headers = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    slow_head = headers + b"X-Padding: " + b"a" * 200 + b"\r\n\r\n" + body
    slow_body = headers + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    with serving(model, request_timeout=1.5, max_connections=64) as url:
        stop, outcomes, threads = threading.Event(), [], []

        def slow_client(kind: str):
            s = _connect(url)
            if kind == "body":  # the whole head at once, then the body a byte at a time
                s.sendall(slow_body[:slow_body.index(b"\r\n\r\n") + 4])
                data = body
            else:
                data = slow_head if kind == "head" else b""
            feeder = threading.Thread(target=_dribble, args=(s, data, 0.2, stop), daemon=True)
            feeder.start()
            started = time.monotonic()
            got = _read_all(s)
            outcomes.append((kind, time.monotonic() - started, got))
            s.close()

        for kind in ["head"] * 15 + ["body"] * 15 + ["silent"] * 5:
            threads.append(threading.Thread(target=slow_client, args=(kind,), daemon=True))
            threads[-1].start()
        time.sleep(0.5)
        during = [call(url, "GET", "/health")[0] for _ in range(3)]
        answered = call(url, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        for t in threads:
            t.join(20)
        stop.set()
    assert during == [200] * 3 and answered[0] == 200
    assert len(outcomes) == 35, "some slow clients were never dropped"
    for kind, seconds, got in outcomes:
        assert seconds < 6.0, (kind, seconds)
        if kind == "silent":
            assert got == b"", got  # nothing was asked: closed without an answer
        else:
            assert _openai_error(got, 408)["code"] == "request_timeout"


def test_connections_past_the_cap_get_503_at_once(model):
    with serving(model, request_timeout=2.0, max_connections=8) as url:
        held = [_connect(url) for _ in range(8)]
        time.sleep(0.3)
        extra = _connect(url)
        started = time.monotonic()
        refused = _read_all(extra)
        took = time.monotonic() - started
        for s in held:
            assert _read_all(s) == b""  # idle: closed at the request deadline
            s.close()
        after = call(url, "GET", "/health")[0]
    assert took < 1.0 and _openai_error(refused, 503)["code"] == "busy"
    assert after == 200


def _statuses(raw: bytes) -> list[int]:
    """The status of each answer in ``raw``, walking the answers by their Content-Length."""
    statuses = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        statuses.append(int(lines[0].split()[1]))
        length = next(int(v) for k, _, v in (line.partition(b":") for line in lines[1:])
                      if k.strip().lower() == b"content-length")
        raw = rest[length:]
    return statuses


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize("keyed_first", [True, False])
def test_pipelined_requests_each_get_their_status(model, method, keyed_first):
    def request(keyed: bool) -> bytes:
        auth = b"Authorization: Bearer sesame\r\n" if keyed else b""
        if method == "GET":
            return b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n"
        body = json.dumps({"prompt": "Hi", "max_tokens": 2, "temperature": 0}).encode()
        return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth
                + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)

    last = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with serving(model, api_key="sesame") as url:
        s = _connect(url)
        s.sendall(request(keyed_first) + request(not keyed_first) + last)
        raw = _read_all(s)
        s.close()
    expected = [200, 401] if keyed_first else [401, 200]
    assert _statuses(raw) == expected + [200]


def _completion(url: str, stream: bool) -> tuple[int, bytes]:
    s = _connect(url)
    s.settimeout(120)
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 4, "stream": stream}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    raw = _read_all(s)
    s.close()
    return int(raw.split(b" ", 2)[1]), raw.partition(b"\r\n\r\n")[2]


def _check_answer(status: int, body: bytes, stream: bool) -> str:
    if status != 200:
        assert status == 503, (status, body[:300])
        assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
        return "503"
    if stream:  # chunked: the events are in it as lines
        events = [line for line in body.split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]" and not any(b'"error"' in e for e in events), body[-500:]
        finishes = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finishes[-1] in ("stop", "length") and not any(finishes[:-1]), finishes
    else:
        answer = json.loads(body)
        assert "error" not in answer and answer["choices"][0]["finish_reason"] in ("stop", "length"), answer
    return "200"


@pytest.mark.slow
def test_two_hundred_concurrent_completions_end_whole_or_with_a_status(model):
    results = []
    with serving(model, max_batch=4, max_queue=8) as url:
        def ask(i):
            results.append((i % 2 == 1, *_completion(url, stream=i % 2 == 1)))

        threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(200)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    assert len(results) == 200
    outcomes = [_check_answer(status, body, stream) for stream, status, body in results]
    assert outcomes.count("200") >= 12 and "503" in outcomes, outcomes.count("200")


def test_a_stream_that_cannot_be_admitted_is_a_503_not_a_200(model, monkeypatch):
    from tmac.models.run.batching import Batcher

    def no_memory(self, prompt):
        raise MemoryError("cannot allocate 1 GiB")

    monkeypatch.setattr(Batcher, "_cache_for", no_memory)
    with serving(model) as url:
        streamed = _completion(url, stream=True)
        whole = _completion(url, stream=False)
    for status, body in (streamed, whole):
        assert status == 503, body[:300]
        error = json.loads(body)["error"]
        assert error["code"] == "busy" and "no memory for another KV cache" in error["message"]


def test_the_server_listens_on_ipv6_loopback(model):
    import uvicorn

    from tmac.apps.serve import create_app
    from tmac.apps.serve_http import server_config

    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(server_config(create_app(model, "m", log=None), "::1", port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start on ::1"
            time.sleep(0.05)
        with socket.create_connection(("::1", port), timeout=10) as c:
            c.sendall(b"GET /health HTTP/1.1\r\nHost: [::1]\r\nConnection: close\r\n\r\n")
            assert _read_all(c).startswith(b"HTTP/1.1 200 ")
    finally:
        server.should_exit = True
        thread.join(30)
