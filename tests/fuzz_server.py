"""Fuzz targets for the server and for mapped model files (``tests/fuzz_targets.py`` runs them):

- ``server``: a real ``tmac serve`` app (uvicorn on loopback, in this process) sent hostile requests — sampling
  fields of every type and extreme value, request bodies mutated as bytes (truncated, invalid UTF-8, a BOM, deep
  nesting, past the size limit, lone surrogates, numbers past float), and slow clients dribbling headers or a body:
  each ends in a 200 that is a whole answer or an error status in OpenAI's shape (never a 500), a slow client in a
  408 within its timeout, and ``/health`` answers after every case;
- ``mapped``: a ``.tmac`` file changed while a model is loaded from it or runs from it — replaced by tmac's own
  writer, removed, renamed over, and (read with ``mmap=False`` only: mapped, the process would die by SIGBUS, as
  documented) truncated, overwritten or flipped in place: the model computes exactly the pristine file's logits,
  or (changed during its load) refuses the file naming it or computes the logits of the file it then read.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import threading
import time

from hypothesis import strategies as st

REQUEST_TIMEOUT = 1.0
BODY_LIMIT = 64 << 10
FIELDS = ["temperature", "top_p", "top_k", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty",
          "max_tokens", "n_predict", "seed", "logit_bias", "stop", "logprobs", "top_logprobs", "n", "stream",
          "ignore_eos", "echo", "response_format", "stream_options", "model", "user", "typical_p", "mirostat"]
VALUES = [None, True, False, 0, 1, -1, 2, 7, 20, 21, 2**31, 2**63, -2**63, 10**30, 0.5, -0.5, 1e-320, 5e-324, 1e308,
          -1e308, 1e999, -1e999, "NaN", "", "x", "\ud800", "a\ud83d", "1", [], [1], ["a"] * 5, ["x" * 2000],
          {}, {"1": 100}, {"0": -1e308}, {"-5": 1}, {"x": 1}, {"999999": 1}, {"type": "json_object"},
          {"include_usage": True}]
PATHS = ["/v1/completions", "/v1/chat/completions"]
BYTE_EDITS = ["truncate", "flip", "bom", "invalid utf-8", "nest", "too large", "surrogate", "huge number",
              "duplicate keys", "spaces before", "no body", "not an object", "wrong content type"]


def _start_server(d: str):
    import uvicorn
    from fuzz_targets import write_gguf

    import tmac
    from tmac.apps.serve import create_app
    from tmac.apps.serve_http import server_config

    write_gguf(os.path.join(d, "seed.gguf"))
    model = tmac.load_model(os.path.join(d, "seed.gguf"), context=64, progress=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(model, "seed", max_batch=2, max_queue=4, log=None, max_body=BODY_LIMIT)
    server = uvicorn.Server(server_config(app, "127.0.0.1", port, request_timeout=REQUEST_TIMEOUT,
                                          max_connections=32, log_level="critical"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    return port


def _valid(path: str, stream: bool) -> dict:
    body = {"max_tokens": 2, "stream": stream}
    if path.endswith("chat/completions"):
        return {**body, "messages": [{"role": "user", "content": "Hi"}]}
    return {**body, "prompt": "Hi"}


def _edit(raw: bytes, edit: str, at: float) -> tuple[bytes, str]:
    """``raw`` (a valid JSON body) changed by ``edit``; the content type to send."""
    pos = int(at * len(raw))
    kind = "application/json"
    if edit == "truncate":
        raw = raw[:pos]
    elif edit == "flip":
        raw = raw[:pos] + bytes([raw[min(pos, len(raw) - 1)] ^ 0x55]) + raw[pos + 1:]
    elif edit == "bom":
        raw = b"\xef\xbb\xbf" + raw
    elif edit == "invalid utf-8":
        raw = raw.replace(b"Hi", b"H\xff\xfei")
    elif edit == "nest":
        depth = 10 ** (1 + int(at * 5))
        raw = raw[:-1] + b', "extra": ' + b"[" * depth + b"]" * depth + b"}"
    elif edit == "too large":
        raw = b" " * (BODY_LIMIT + 1) + raw
    elif edit == "surrogate":
        raw = raw.replace(b"Hi", b"\\ud800\\udbff x \\udc00")
    elif edit == "huge number":
        raw = raw.replace(b'"max_tokens": 2', b'"max_tokens": 1' + b"0" * 400)
    elif edit == "duplicate keys":
        raw = raw[:-1] + b', "max_tokens": -5, "max_tokens": 3}'
    elif edit == "spaces before":
        raw = b" " * (BODY_LIMIT - len(raw) - 1) + raw
    elif edit == "no body":
        raw = b""
    elif edit == "not an object":
        raw = b"[" + raw + b"]"
    elif edit == "wrong content type":
        kind = "text/plain"
    return raw, kind


def _check_answer(status: int, body: bytes, stream: bool) -> str:
    assert status != 500 and status < 600, (status, body[:500])
    if status != 200:
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), body[:500]
        return str(status)
    if stream:
        events = [line for line in body.split(b"\n") if line.startswith(b"data: ")]
        assert events and events[-1] == b"data: [DONE]", body[-500:]
        assert not any(b'"error"' in e for e in events), body[-500:]
        return "200 streamed"
    answer = json.loads(body)
    assert "error" not in answer and answer["choices"][0]["finish_reason"] in ("stop", "length"), answer
    return "200"


def _slow(port: int, kind: str, every: float) -> str:
    """A client that sends its request a byte every ``every`` seconds (``silent``: nothing): answered 408 (or closed,
    when it sent nothing) within the timeout and a little."""
    body = json.dumps(_valid(PATHS[0], False)).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " \
           f"{len(body)}\r\n\r\n".encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=REQUEST_TIMEOUT + 10)
    stop = threading.Event()
    data = (head + body) if kind == "head" else body if kind == "body" else b""
    if kind == "body":
        s.sendall(head)

    def dribble():
        for byte in data:
            if stop.is_set():
                return
            try:
                s.sendall(bytes([byte]))
            except OSError:
                return
            time.sleep(every)

    threading.Thread(target=dribble, daemon=True).start()
    started, got = time.monotonic(), b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    finally:
        stop.set()
        s.close()
    took = time.monotonic() - started
    assert took < REQUEST_TIMEOUT + 3, took
    if not got:
        assert kind == "silent" or every * len(data) < REQUEST_TIMEOUT, (kind, every)
        return "closed"
    status = int(got.split(b" ", 2)[1])
    if status == 408:
        _check_answer(status, got.partition(b"\r\n\r\n")[2], False)
        return "408 slow"
    return _check_answer(status, got.partition(b"\r\n\r\n")[2], False) + " (fast enough)"


def _healthy(port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
    finally:
        conn.close()


def server_cases(d: str):
    port = _start_server(d)

    def send(path: str, raw: bytes, kind: str, stream: bool) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            conn.request("POST", path, raw, {"content-type": kind})
            r = conn.getresponse()
            return _check_answer(r.status, r.read(), stream)
        except (ConnectionResetError, BrokenPipeError):  # a body past the limit: answered 413 while being sent
            return "413 (reset)" if len(raw) > BODY_LIMIT else "reset"
        finally:
            conn.close()

    def check(case) -> str:
        kind = case[0]
        if kind == "fields":
            _, path, fields, stream = case
            body = {**_valid(path, stream), **fields}
            try:
                raw = json.dumps(body).encode()
            except UnicodeEncodeError:  # (json.dumps escapes lone surrogates; kept for other encoders)
                raw = json.dumps(body, ensure_ascii=True).encode()
            outcome = send(path, raw, "application/json", bool(body.get("stream")) and fields.get("stream") in
                           (None, True))
        elif kind == "bytes":
            _, path, edit, at, stream = case
            raw, content_type = _edit(json.dumps(_valid(path, stream)).encode(), edit, at)
            outcome = send(path, raw, content_type, stream)
        else:
            _, how, every = case
            outcome = _slow(port, how, every)
        _healthy(port)
        return outcome

    fields = st.tuples(st.just("fields"), st.sampled_from(PATHS),
                       st.dictionaries(st.sampled_from(FIELDS), st.sampled_from(VALUES), max_size=4), st.booleans())
    edits = st.tuples(st.just("bytes"), st.sampled_from(PATHS), st.sampled_from(BYTE_EDITS),
                      st.floats(0, 1), st.booleans())
    slow = st.tuples(st.just("slow"), st.sampled_from(["head", "body", "silent"]), st.sampled_from([0.05, 0.2]))
    return st.one_of(fields, edits, slow), check


# ---- mapped files ----------------------------------------------------------------------------------------------

SAFE_CHANGES = ["tmac.save over it", "removed", "renamed over", "appended to"]
IN_PLACE_CHANGES = ["truncated", "overwritten in place", "bytes flipped in place"]


def mapped_cases(d: str):
    import numpy as np
    from fuzz_targets import write_gguf, write_tmac
    from tmac.models.files.tmac_file import save_model

    import tmac
    from tmac import ModelFormatError

    seed, other = os.path.join(d, "seed.tmac"), os.path.join(d, "other.tmac")
    write_gguf(os.path.join(d, "seed.gguf"))
    write_tmac(os.path.join(d, "seed.gguf"), seed)
    other_model = tmac.load_model(os.path.join(d, "seed.gguf"), bits=2, context=8, progress=False)
    save_model(other_model, other)
    ids = [0, 1, 2]

    def logits(model) -> np.ndarray:
        return tmac.Session(model).logits(ids).numpy()

    pristine, changed = logits(tmac.load_model(seed, context=8)), logits(tmac.load_model(other, context=8))
    counter = [0]

    def change(path: str, how: str, at: float) -> None:
        size = os.path.getsize(path)
        if how == "tmac.save over it":
            save_model(other_model, path)
        elif how == "removed":
            os.unlink(path)
        elif how == "renamed over":
            with open(path + ".new", "wb") as f:
                f.write(os.urandom(4096))
            os.replace(path + ".new", path)
        elif how == "appended to":
            with open(path, "ab") as f:
                f.write(b"\0" * 4096)
        elif how == "truncated":
            os.truncate(path, int(at * size))
        elif how == "overwritten in place":
            with open(path, "r+b") as f, open(other, "rb") as g:
                f.write(g.read())
        else:
            with open(path, "r+b") as f:
                f.seek(int(at * (size - 64)))
                f.write(os.urandom(64))

    def check(case) -> str:
        how, mapped, during, at, delay = case
        counter[0] += 1
        path = os.path.join(d, f"case{counter[0]}.tmac")
        shutil.copy(seed, path)
        old = time.time() - 3600
        os.utime(path, (old, old))  # (as model files are: a write now changes its time, which a read sees)
        timer = threading.Timer(delay, change, (path, how, at)) if during else None
        try:
            if timer:
                timer.start()
            try:
                model = tmac.load_model(path, context=8, mmap=mapped)
            except (ModelFormatError, FileNotFoundError) as e:
                assert during and path in str(e), f"{type(e).__name__}: {e}"
                return "refused (changed while loading)"
            finally:
                if timer:
                    timer.join()
            if not during:
                change(path, how, at)
            got = logits(model)
        finally:
            if os.path.exists(path):
                os.unlink(path)
        if np.array_equal(got, pristine):
            return "ran as the pristine file"
        assert during, (case, float(np.abs(got - pristine).max()))
        if how == "bytes flipped in place":  # flipped before the read began: a damaged file, read whole
            assert np.isfinite(got).all()
            return "ran on the damaged file"
        assert np.array_equal(got, changed), (case, float(np.abs(got - pristine).max()))
        return "ran as the file that replaced it"

    safe = st.tuples(st.sampled_from(SAFE_CHANGES), st.booleans(), st.booleans(), st.floats(0, 1),
                     st.sampled_from([0.0, 0.001, 0.005, 0.02]))
    in_place = st.tuples(st.sampled_from(IN_PLACE_CHANGES), st.just(False), st.booleans(), st.floats(0, 1),
                         st.sampled_from([0.0, 0.001, 0.005, 0.02]))
    return st.one_of(safe, in_place), check


SERVER_TARGETS = {"server": server_cases, "mapped": mapped_cases}
