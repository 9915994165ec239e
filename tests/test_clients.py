"""What the clients and habits people bring expect of ``tmac serve``: the official ``openai`` client sending what
LangChain, LlamaIndex and Open WebUI send (fields that are not served are ignored, not refused), a previous answer
sent back as it came, log-probabilities and logit bias as OpenAI defines them (checked against the model's own
logits in float64 numpy), any model name, llama.cpp's server's ``/tokenize``, ``/detokenize``, ``/props``,
``/metrics``, one log line a request, a client hanging up on a whole answer, and SIGTERM or Ctrl-C during a stream
ending the process within 2 seconds without a traceback."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import tmac
from conftest import smollm2_path
from test_serve import QUESTION, call, client, health, serving, streaming, wait_idle
from tmac.models.run.sampling import SamplingParams


@pytest.fixture(scope="module")
def model():
    return tmac.load_model(smollm2_path(), context=512, progress=False)


@pytest.fixture(scope="module")
def server(model):
    lines = []
    with serving(model, max_batch=4, name=tmac_serve_names(model), log=lines.append) as url:
        yield url, lines


def tmac_serve_names(model):
    from tmac.apps.serve import Served

    return Served("smol", "ORG/NAME", os.path.basename(model.source))


def log_softmax(logits) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def greedy_with_logits(model, prompt_ids, n, bias=None):
    """The greedy tokens after ``prompt_ids`` and each step's log-softmax in float64, from the logits of the
    prompt's prefill plan and then the model's one-row decode plan fed a token at a time (the numbers the server
    computes; the eager forward rounds differently), ``bias`` (token → added logit) applied before the argmax."""
    import torch

    from tmac.models.run.decode import Plans
    from tmac.models.run.generate import prefill
    from tmac.models.run.sequence import Sequence

    plans = Plans(model).current()
    plan, sequence = plans.decode(1), Sequence(model, adopt=False)
    ids, steps = list(prompt_ids), []
    with torch.inference_mode():
        fed = [logits[-1].clone() for _, logits in prefill(model, ids, sequence, last_only=True, plans=plans)][-1]
        sequence.ids = list(ids)
        for i in range(n):
            raw = (fed if i == 0 else plan.step(ids[-1], len(ids) - 1, sequence)).float().numpy().copy()
            if i:
                sequence.ids.append(ids[-1])
            logits = raw.astype(np.float64)
            for t, b in (bias or {}).items():
                logits[t] += b
            steps.append(log_softmax(raw))
            ids.append(int(np.argmax(logits)))
    return ids[len(prompt_ids):], steps


def chat_ids(model, messages):
    return model.tokenizer.encode(model.tokenizer.render_chat(messages))


def test_fields_clients_send_are_accepted_and_a_previous_answer_goes_back_as_it_came(server):
    url, lines = server
    c = client(url)
    plain = c.chat.completions.create(model="smol", messages=QUESTION, max_tokens=12, temperature=0)
    sent = dict(logprobs=False, store=False, metadata={"app": "test"}, service_tier="auto",
                parallel_tool_calls=False, response_format={"type": "text"}, user="someone",
                tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                tool_choice="auto", extra_body={"min_p": 0.05, "cache_prompt": True})
    r = c.chat.completions.create(model="smol", messages=QUESTION, max_tokens=12, temperature=0, **sent)
    assert r.choices[0].message.content == plain.choices[0].message.content  # none of them changes the answer
    turns = [*QUESTION, r.choices[0].message.model_dump(), {"role": "user", "content": "And of Italy?"}]
    assert "refusal" in turns[1]  # (what the client's answer carries: its fields all go back)
    again = c.chat.completions.create(model="smol", messages=turns, max_tokens=12, temperature=0)
    assert again.choices[0].message.content
    done = c.completions.create(model="smol", prompt="Once upon a time", temperature=0, echo=True, suffix="",
                                user="someone", extra_body={"cache_prompt": True, "n_predict": 8})  # (llama.cpp's)
    assert done.choices[0].text.startswith("Once upon a time") and done.usage.completion_tokens == 8
    ignored = [line for line in lines if line.startswith("ignoring request field")]
    assert ignored and "store" in " ".join(ignored) and "min_p" not in " ".join(ignored)
    assert sum(line.count("store") for line in ignored) == 1  # said once
    with pytest.raises(Exception, match="n = 1"):
        c.chat.completions.create(model="smol", messages=QUESTION, max_tokens=4, n=2)


def test_logprobs_are_the_models_log_softmax(server, model):
    url, _ = server
    ids = chat_ids(model, QUESTION)
    want, steps = greedy_with_logits(model, ids, 5)
    r = client(url).chat.completions.create(model="smol", messages=QUESTION, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry, token, lp in zip(content, want, steps):
        assert entry.token == model.tokenizer.decode([token])
        assert abs(entry.logprob - lp[token]) < 1e-6
        best = np.argsort(-lp, kind="stable")[:3]
        assert [t.token for t in entry.top_logprobs] == [model.tokenizer.decode([int(t)]) for t in best]
        assert np.allclose([t.logprob for t in entry.top_logprobs], lp[best], atol=1e-6)
    pieces = client(url).chat.completions.create(model="smol", messages=QUESTION, max_tokens=5, temperature=0,
                                                 logprobs=True, stream=True)
    streamed = [e.logprob for p in pieces if p.choices and p.choices[0].logprobs for e in p.choices[0].logprobs.content]
    assert np.allclose(streamed, [lp[t] for t, lp in zip(want, steps)], atol=1e-6)
    done = client(url).completions.create(model="smol", prompt="The sky is", max_tokens=3, temperature=0, logprobs=2)
    want, steps = greedy_with_logits(model, model.tokenizer.encode("The sky is"), 3)
    assert np.allclose(done.choices[0].logprobs.token_logprobs, [lp[t] for t, lp in zip(want, steps)], atol=1e-6)
    assert all(len(top) == 2 for top in done.choices[0].logprobs.top_logprobs)


def test_logit_bias_moves_the_logits_as_openai_defines(server, model):
    url, _ = server
    ids = chat_ids(model, QUESTION)
    plain, _ = greedy_with_logits(model, ids, 4)
    bias = {plain[0]: -100.0, plain[1]: 3.0}
    want, _ = greedy_with_logits(model, ids, 4, bias)
    r = client(url).chat.completions.create(model="smol", messages=QUESTION, max_tokens=4, temperature=0,
                                            logit_bias={str(t): b for t, b in bias.items()})
    assert want != plain and r.choices[0].message.content == model.tokenizer.decode(want, skip_special=True)


def test_any_model_name_is_answered_and_the_server_says_its_own(server):
    url, _ = server
    for asked in ("smol", "ORG/NAME", "gpt-4o"):
        r = client(url).chat.completions.create(model=asked, messages=QUESTION, max_tokens=2, temperature=0)
        assert r.model == "smol"
    status, _, body = call(url, "POST", "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2})  # curl's
    assert status == 200 and body["model"] == "smol"
    assert [m.id for m in client(url).models.list().data] == ["smol"]
    assert call(url, "GET", "/v1/models/ORG/NAME")[0] == 200 and call(url, "GET", "/v1/models/other")[0] == 404


def test_llama_servers_endpoints(server, model):
    url, _ = server
    status, _, body = call(url, "POST", "/tokenize", {"content": "Hello world"})
    assert status == 200 and body["tokens"] == model.tokenizer.encode("Hello world")
    pieces = call(url, "POST", "/tokenize", {"content": "Hello world", "with_pieces": True})[2]["tokens"]
    assert "".join(p["piece"] for p in pieces) == "Hello world"
    assert call(url, "POST", "/detokenize", {"tokens": body["tokens"]})[2] == {"content": "Hello world"}
    assert call(url, "POST", "/detokenize", {"tokens": [10 ** 9]})[0] == 400
    props = call(url, "GET", "/props")[2]
    assert props["n_ctx"] == 512 and props["total_slots"] == 4
    assert props["default_generation_settings"]["temperature"] == SamplingParams().temperature
    assert call(url, "GET", "/")[0] == 200
    client(url).completions.create(model="smol", prompt="Hi", max_tokens=3, temperature=0)
    wait_idle(url)
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        text = b"".join(iter(lambda: s.recv(65536), b"")).decode()
    assert "text/plain" in text.split("\r\n\r\n")[0]
    values = {line.split()[0]: float(line.split()[1]) for line in text.split("\r\n\r\n", 1)[1].splitlines()
              if line and not line.startswith("#")}
    h = health(url)
    assert values["tmac_decode_steps_total"] == h["steps"] and values["tmac_requests_total"] >= 1
    assert values["tmac_prompt_tokens_prefilled_total"] == h["prefilled"]


def test_one_line_is_logged_a_request(server):
    url, lines = server
    before = len(lines)
    client(url).completions.create(model="smol", prompt="Once upon a time", max_tokens=6, temperature=0,
                                   extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 10
    while not any("POST /v1/completions 200" in line for line in lines[before:]) and time.monotonic() < deadline:
        time.sleep(0.05)
    line = next(line for line in lines[before:] if "POST /v1/completions 200" in line)
    assert "prompt 4 tokens" in line and "generated 6 in" in line and "tok/s" in line and "length" in line


def test_a_whole_answer_stops_when_its_client_hangs_up(server):
    url, _ = server
    wait_idle(url)
    steps = health(url)["steps"]
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True})
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        deadline = time.monotonic() + 30
        while health(url)["steps"] - steps < 5:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    wait_idle(url)
    assert health(url)["steps"] - steps < 100  # it left long before its 400 tokens


def test_session_cli_and_server_sample_alike_from_one_seed(server, model):
    """The same defaults and the same seed give the same answer through the Python API, the command line and the
    server: one set of options, one sampler."""
    url, _ = server
    question = "Tell me a story about a lighthouse keeper."  # (an open question: sampling leaves the greedy text)
    asked = [{"role": "user", "content": question}]
    by_session = tmac.Session(model).chat(asked, seed=7, max_tokens=24)
    run = subprocess.run([sys.executable, "-m", "tmac", "run", "-c", "512", "-p", question, "-n", "24", "--seed",
                          "7", "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    by_server = client(url).chat.completions.create(model="smol", messages=asked, max_tokens=24, seed=7)
    assert json.loads(run.stdout)["text"] == by_session == by_server.choices[0].message.content
    greedy = tmac.Session(model).chat(asked, seed=7, max_tokens=24, temperature=0)
    assert by_session != greedy  # (the defaults sample)


def _serve(*args, env=None):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tmac", "serve", "--port", str(port), "-c", "2048", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
        try:
            if call(url, "GET", "/health")[0] == 200:
                return proc, url
        except OSError:
            time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_a_long_stream_stops_the_server_within_two_seconds(sig):
    proc, url = _serve("--alias", "story")
    try:
        story = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        got = []
        with streaming(url, "/v1/completions", story) as lines:
            for line in lines:
                got.append(line)
                if len(got) > 20:
                    break
            proc.send_signal(sig)
            sent = time.monotonic()
            got += list(lines)  # the rest of the stream, to its end
            rc = proc.wait(10)
            took = time.monotonic() - sent
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert took < 2.0 and rc == 0, (took, rc, err)
    assert "shutting down" in err and "Traceback" not in err
    chunks = [json.loads(line[6:]) for line in got if line.startswith("data: {")]
    events = [line.strip() for line in got if line.startswith("data: ")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort" and events[-1] == "data: [DONE]"


@pytest.mark.slow
def test_a_busy_port_is_said_before_loading():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "tmac", "serve", "--port", str(port)], capture_output=True,
                           text=True, timeout=120)
        took = time.monotonic() - t0
    assert r.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in r.stderr and "loading" not in r.stderr
    assert took < 10, took  # (the import, not a model's load)


def test_an_open_bind_without_a_key_is_warned_about():
    from tmac.apps.cli_generate import open_bind_warning

    assert "without --api-key" in open_bind_warning("0.0.0.0", None)
    assert open_bind_warning("0.0.0.0", "key") is None
    assert open_bind_warning("127.0.0.1", None) is None and open_bind_warning("::1", None) is None
