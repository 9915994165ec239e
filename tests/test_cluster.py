"""``tmac serve`` on Ray Serve (``tmac.apps.cluster``): a local Ray cluster on loopback with 2 replicas of the default
model at 1 thread each, driven by the official ``openai`` client — greedy answers equal ``tmac serve``'s, 8
concurrent clients are all answered, each conversation reaches its rendezvous-hash replica and reuses its cached
prefix there, and a replica killed mid-run costs only its in-flight requests a retryable error (or a transparent
retry) while Serve starts a new one."""
import json
import os
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install 'tmac[cluster]'); make test "
                                        "installs it")
serve = pytest.importorskip("ray.serve")

from conftest import smollm2_path  # noqa: E402
from test_serve import serving  # noqa: E402

import tmac  # noqa: E402
from tmac.apps.cluster import APP_NAME, affinity_key, deployment, rendezvous  # noqa: E402


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_tmac_serve_on_ray_serve():
    """The steps below against one local cluster (one at a time, whichever pytest worker runs this), then the
    ``tmac serve --ray`` command itself."""
    import shutil
    import tempfile

    temp = tempfile.mkdtemp(prefix="ray")  # (short: Ray's socket paths must fit 107 characters)
    ray.init(address="local", num_cpus=3, include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=temp,
             logging_level="warning", log_to_driver=False)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment(smollm2_path(), replicas=2, threads=1, context=512), name=APP_NAME, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        for step in (greedy_answers_equal_tmac_serves, each_conversation_reaches_its_rendezvous_replica,
                     eight_concurrent_clients_are_all_answered,
                     a_conversation_stays_on_its_replica_and_reuses_its_prefix,
                     a_killed_replica_costs_only_its_requests_and_is_replaced):
            step(url)
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    the_command_serves_and_stops_on_sigterm()


def _client(url):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _replicas(expected: int = 2, deadline_s: float = 120.0) -> dict[str, int]:
    """Replica id → process id of the running replicas, asked until ``expected`` distinct ones answered."""
    handle = serve.get_deployment_handle("Replica", app_name=APP_NAME)
    found: dict[str, int] = {}
    deadline = time.monotonic() + deadline_s
    while len(found) < expected:
        assert time.monotonic() < deadline, found
        try:
            rid, pid = handle.identity.remote().result(timeout_s=30)
            found[rid] = pid
        except Exception:  # noqa: BLE001  (a replica starting or stopping)
            time.sleep(0.5)
    return found


def _home(body: dict, replicas) -> str:
    return rendezvous(affinity_key(json.dumps(body).encode()), list(replicas))[0]


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def greedy_answers_equal_tmac_serves(cluster):
    model = tmac.load_model(smollm2_path(), context=512, progress=False)
    with serving(model) as single:
        want = [_client(single).chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=24),
                _client(single).completions.create(model="m", prompt="The sky is", temperature=0, max_tokens=16)]
    got_chat = _client(cluster).chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=24)
    got_text = _client(cluster).completions.create(model="m", prompt="The sky is", temperature=0, max_tokens=16)
    assert got_chat.choices[0].message.content == want[0].choices[0].message.content
    assert got_text.choices[0].text == want[1].choices[0].text
    streamed = _client(cluster).chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=24,
                                                         stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        want[0].choices[0].message.content
    bad = _client(cluster).with_options(max_retries=0)
    with pytest.raises(Exception) as e:  # the same errors as tmac serve: the app is the same
        bad.chat.completions.create(model="m", messages=QUESTION, temperature=-1)
    assert getattr(e.value, "status_code", None) == 400 and "temperature" in str(e.value)


def _fruit(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Name a fruit whose name starts with {'ABCDEFGH'[i]}."}]}


def each_conversation_reaches_its_rendezvous_replica(cluster):
    replicas = _replicas()
    routed = []
    for i in range(8):  # one at a time: no replica is busier than another
        r = _client(cluster).chat.completions.with_raw_response.create(model="m", temperature=0, max_tokens=4,
                                                                       **_fruit(i))
        routed.append((r.headers.get("x-tmac-replica"), _home(_fruit(i), replicas)))
    assert all(got == home for got, home in routed), routed
    assert {home for _, home in routed} == set(replicas)  # (these eight prompts hash to both)


def eight_concurrent_clients_are_all_answered(cluster):
    alone = [_client(cluster).chat.completions.create(model="m", temperature=0, max_tokens=12, **_fruit(i))
             .choices[0].message.content for i in range(8)]
    results = {}

    def ask(i):
        results[i] = _client(cluster).chat.completions.create(model="m", temperature=0, max_tokens=12,
                                                              **_fruit(i)).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert [results.get(i) for i in range(8)] == alone


def a_conversation_stays_on_its_replica_and_reuses_its_prefix(cluster):
    messages, seen, cached = [{"role": "system", "content": "You are terse."}], set(), []
    for question in ("Name a planet.", "Name another one.", "And a third?"):
        messages.append({"role": "user", "content": question})
        r = _client(cluster).chat.completions.with_raw_response.create(model="m", messages=messages, temperature=0,
                                                                       max_tokens=12)
        answer = r.parse()
        seen.add(r.headers.get("x-tmac-replica"))
        cached.append(answer.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    # (the first turn may share a template's first tokens with earlier requests; later ones, their history)
    assert len(seen) == 1 and cached[0] < 10 < cached[1] < cached[2], (seen, cached)


def a_killed_replica_costs_only_its_requests_and_is_replaced(cluster):
    replicas = _replicas()
    # conversations homed on either replica (replica ids are random: enough topics that both get some, all but
    # surely); the stream starts alone, so it reaches its home, then two whole answers homed there join it (the
    # router may send them elsewhere when the home is busier), and the replica the stream names is killed
    topics = [f"{adjective} {thing}" for adjective in ("an old", "a small", "a red", "a quiet", "a lost")
              for thing in ("lighthouse", "dragon", "robot", "garden", "train")]
    bodies = [{"messages": [{"role": "user", "content": f"Tell me a long story about {topic}."}]} for topic in topics]
    home = _home(bodies[0], replicas)
    on_home = [b for b in bodies if _home(b, replicas) == home]
    survivor_body = next(b for b in bodies if _home(b, replicas) != home)
    events, outcomes, reached = [], [], []

    def stream():
        try:
            raw = _client(cluster).chat.completions.with_raw_response.create(
                model="m", max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}, **on_home[0])
            reached.append(raw.headers.get("x-tmac-replica"))
            for chunk in raw.parse():
                events.append(chunk)
            outcomes.append("stream finished")
        except Exception as e:  # noqa: BLE001
            outcomes.append(f"stream error: {type(e).__name__}: {e}")

    def whole(body):
        try:
            r = _client(cluster).chat.completions.create(model="m", max_tokens=200, temperature=0,
                                                         extra_body={"ignore_eos": True}, **body)
            outcomes.append(f"whole {r.choices[0].finish_reason}")
        except Exception as e:  # noqa: BLE001
            outcomes.append(f"whole error: {getattr(e, 'status_code', None)}: {e}")

    def until(enough):
        deadline = time.monotonic() + 120
        while len(events) < enough:
            assert time.monotonic() < deadline and threads[0].is_alive(), outcomes
            time.sleep(0.05)

    threads = [threading.Thread(target=stream)]
    threads[0].start()
    until(2)
    assert reached == [home], (reached, home)  # (an idle cluster: the conversation's home)
    threads += [threading.Thread(target=whole, args=(b,)) for b in on_home[1:3]]
    for t in threads[1:]:
        t.start()
    until(40)  # (the whole answers have reached a replica meanwhile)
    pid = replicas[home]
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(180)
    stream_outcome = [o for o in outcomes if o.startswith("stream")]
    assert stream_outcome and ("replica_unavailable" in stream_outcome[0] or "send it again" in stream_outcome[0]), \
        outcomes
    for o in outcomes:  # the whole answers: retried elsewhere, or a 503 saying to retry
        if o.startswith("whole"):
            assert o in ("whole length", "whole stop") or o.startswith("whole error: 503"), outcomes
    after = _client(cluster).chat.completions.create(model="m", max_tokens=8, temperature=0, **survivor_body)
    assert after.choices[0].message.content
    again = _client(cluster).chat.completions.create(model="m", max_tokens=8, temperature=0, **on_home[0])
    assert again.choices[0].message.content  # its conversation is answered by another replica meanwhile
    restored = _replicas(expected=2, deadline_s=180)
    assert pid not in restored.values() and len(restored) == 2


def the_command_serves_and_stops_on_sigterm():
    import subprocess
    import sys

    from test_serve import call

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tmac", "serve", smollm2_path(), "--ray", "--replicas", "1",
                             "--port", str(port), "-c", "512"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "RAY_ADDRESS": ""})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            try:  # (Ray's proxy answers 404 in plain text until the application is deployed)
                if call(url, "GET", "/health")[0] == 200:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
        answer = _client(url).chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=8)
        assert answer.choices[0].message.content
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert rc == 0 and "serving at" in err and "shutting down" in err, err[-3000:]
