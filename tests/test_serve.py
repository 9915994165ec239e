"""``tmac serve`` through the official ``openai`` client (and raw HTTP for what a client would not send), against
servers on free loopback ports with the default model: chat and completions, streamed and whole, stop strings,
greedy text equal to ``tmac run``'s, auth, 4xx answers with OpenAI-style bodies, a client leaving mid-stream,
concurrent clients each getting what it gets alone, and a full queue's 503."""
import contextlib
import http.client
import json
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest
import uvicorn

import tmac
from conftest import smollm2_path
from tmac.apps.process import torch_single_threaded
from tmac.apps.serve import create_app, model_name
from tmac.apps.serve_http import server_config

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PROMPTS = ["Tell me a story about a lighthouse keeper.", "Name three fruits.", "Write a haiku about the sea.",
           "Who wrote Hamlet?"]


@pytest.fixture(scope="module")
def model():
    return tmac.load_model(smollm2_path(), context=512, progress=False)


@contextlib.contextmanager
def serving(model, **options):
    """A server on a free loopback port for the block's duration: its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    limits = {k: options.pop(k) for k in ("request_timeout", "max_connections") if k in options}
    app = create_app(model, options.pop("name", model_name(model.source)), **{"log": None, **options})
    server = uvicorn.Server(server_config(app, "127.0.0.1", port, log_level="warning", **limits))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def server(model):
    with serving(model, max_batch=4) as url:
        yield url


def call(url, method, path, body=None, headers=None):
    """(status, headers, parsed JSON body) of one plain HTTP request."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, content, {"content-type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read() or b"null")
    finally:
        conn.close()


@contextlib.contextmanager
def streaming(url, path, body):
    """The lines of a streamed answer, read as they come; leaving the block closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", path, json.dumps(body).encode(), {"content-type": "application/json"})
        r = conn.getresponse()
        yield iter(lambda: r.fp.readline().decode(), "")
    finally:
        conn.close()


def health(url):
    return call(url, "GET", "/health")[2]


def client(url, key="unused"):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def name(url):
    return client(url).models.list().data[0].id


def chat(url, messages=QUESTION, **kw):
    return client(url).chat.completions.create(model=name(url), messages=messages, **{"temperature": 0, **kw})


def test_models_and_health(server, model):
    models = client(server).models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct.Q4_1"] and models[0].object == "model"
    h = health(server)
    assert h["status"] == "ok" and h["max_batch"] == 4


def test_greedy_chat_is_tmac_runs_answer(server):
    run = subprocess.run([sys.executable, "-m", "tmac", "run", "--context", "512", "-p", QUESTION[0]["content"],
                          "-n", "32", "--json", "--temperature", "0"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    expected = json.loads(run.stdout)
    r = chat(server, max_tokens=32)
    assert r.choices[0].message.content == expected["text"] and "Paris" in expected["text"]
    assert r.choices[0].finish_reason == "stop" and r.object == "chat.completion"
    assert r.usage.completion_tokens == expected["generated_tokens"]
    assert r.usage.prompt_tokens == expected["prompt_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_text_is_the_whole_answer_in_pieces(server):
    whole = chat(server, max_tokens=24).choices[0].message.content
    chunks = list(chat(server, max_tokens=24, stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == whole
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == chat(server, max_tokens=24).usage.completion_tokens


def test_completions_whole_and_streamed_with_length_and_stop(server, model):
    c = client(server)
    r = c.completions.create(model=name(server), prompt="The three primary colors are", max_tokens=12, temperature=0)
    text = r.choices[0].text
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    ids = tmac.Session(model).generate(model.tokenizer.encode("The three primary colors are"), max_new_tokens=12,
                                       ignore_eos=True, temperature=0)
    assert text == model.tokenizer.decode(ids, skip_special=True)
    streamed = "".join(p.choices[0].text for p in c.completions.create(
        model=name(server), prompt="The three primary colors are", max_tokens=12, temperature=0, stream=True))
    assert streamed == text
    stop = text.split()[2]
    cut = c.completions.create(model=name(server), prompt="The three primary colors are", max_tokens=12,
                               temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(server):
    a, b = (chat(server, max_tokens=16, temperature=1.0, top_p=0.9, seed=7).choices[0].message.content
            for _ in range(2))
    assert a == b


REPEATING = "Say it again and again: la la la la la la la la"


def penalized_greedy(model, prompt: str, n: int, presence=0.0, frequency=0.0, repeat=1.0, last_n=64) -> str:
    """Greedy text of ``prompt`` with each penalty applied as defined, in float64 numpy, to the logits of the
    prompt's prefill and then of the one-row decode plan: a token sampled c times in the answer loses
    c·frequency + presence (OpenAI's), and each token among the last ``last_n`` of prompt and answer has its logit
    divided by ``repeat`` if positive, else multiplied (llama.cpp's repeat penalty)."""
    import numpy as np
    import torch

    from tmac.models.run.decode import Plans
    from tmac.models.run.generate import prefill
    from tmac.models.run.sequence import Sequence

    plans = Plans(model).current()
    plan, sequence = plans.decode(1), Sequence(model, adopt=False)
    ids, out = model.tokenizer.encode(prompt), []
    with torch.inference_mode(), torch_single_threaded():
        fed = [logits[-1].clone() for _, logits in prefill(model, ids, sequence, last_only=True, plans=plans)][-1]
        token = None
        for pos in range(len(ids), len(ids) + n):
            logits = (fed if token is None else plan.step(token, pos - 1, sequence)).double().numpy().copy()
            for j in (set((ids + out)[-last_n:]) if repeat != 1.0 else ()):
                logits[j] = logits[j] / repeat if logits[j] > 0 else logits[j] * repeat
            for j in set(out):
                logits[j] -= out.count(j) * frequency + presence
            token = int(np.argmax(logits))
            if token in model.tokenizer.stop_ids:
                break
            out.append(token)
    return model.tokenizer.decode(out, skip_special=True)


@pytest.mark.parametrize("options", [dict(presence_penalty=0.6, frequency_penalty=1.2),
                                     dict(presence_penalty=-0.5, frequency_penalty=0.4),
                                     dict(extra_body={"repeat_penalty": 1.5, "repeat_last_n": 8, "top_k": 3})])
def test_sampling_penalties_are_applied_as_defined(server, model, options):
    plain = penalized_greedy(model, REPEATING, 16)
    extra = options.get("extra_body", {})
    expected = penalized_greedy(model, REPEATING, 16, options.get("presence_penalty", 0.0),
                                options.get("frequency_penalty", 0.0), extra.get("repeat_penalty", 1.0),
                                extra.get("repeat_last_n", 64))
    r = client(server).completions.create(model=name(server), prompt=REPEATING, max_tokens=16, temperature=0,
                                          **options)
    assert r.choices[0].text == expected != plain  # (greedy alone repeats itself here)


@pytest.mark.parametrize("body, status, says", [
    (b"{not json", 400, "JSON"),
    ({"model": "M", "messages": "hi"}, 400, "messages"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10 ** 9}, 400, "context"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": -5}, 400, "max_tokens"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "n": 3}, 400, "n"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"x": 5}}, 400, "logit_bias"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 500}}, 400, "logit_bias"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"99999999": 1}}, 400,
     "logit_bias"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     400, "response_format"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400, "tool_choice"),
    ({"model": "M", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     400, "text parts"),
    ({"model": "M", "prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ({"model": "M", "prompt": "x", "min_p": 1.5}, 400, "min_p"),
    (b'{"model": "M", "prompt": "x", "temperature": Infinity}', 400, "temperature"),
    (b'[1, 2]', 400, "JSON object"),
    (b'{"model": "M", "prompt": "\\ud800"}', 400, "prompt: not valid Unicode"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "a\\ud83d"}]}', 400, "messages.0.content"),
    (b'{"model": "M", "prompt": "\xff\xfe"}', 400, "JSON"),
    (b'{"model": "M", "prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, "JSON"),
    ({"model": "M", "prompt": "x", "stop": ["y" * 1001]}, 400, "stop"),
    ({"model": "M", "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ({"model": "M", "messages": []}, 400, "messages"),
    ({"model": "M", "messages": [{"role": "user", "content": "x " * 5000}]}, 400, "context"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "stop": [""]}, 400, "stop"),
    ({"model": "M", "prompt": 5}, 400, "prompt"),
    ({"model": "M", "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"model": "M", "prompt": "x", "frequency_penalty": "lots"}, 400, "frequency_penalty"),
    ({"model": "M", "prompt": "x", "top_k": -1}, 400, "top_k"),
    ({"model": "M", "prompt": "x", "top_k": 1.5}, 400, "top_k"),
    ({"model": "M", "prompt": "x", "repeat_penalty": 0}, 400, "repeat_penalty"),
    ({"model": "M", "prompt": "x", "repeat_last_n": -2}, 400, "repeat_last_n"),
])
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, body, status, says):
    if isinstance(body, dict):
        body = {k: name(server) if v == "M" else v for k, v in body.items()}
    else:
        body = body.replace(b'"M"', json.dumps(name(server)).encode())
    path = "/v1/completions" if ("prompt" in body if isinstance(body, dict) else b'"prompt"' in body) \
        else "/v1/chat/completions"
    code, _, answer = call(server, "POST", path, body)
    assert code == status, answer
    error = answer["error"]
    assert says in error["message"] and error["type"]
    assert chat(server, max_tokens=4).choices[0].message.content  # still serving


def test_unknown_routes_and_methods_are_4xx(server):
    assert call(server, "GET", "/v1/nothing")[0] == 404
    assert call(server, "GET", "/v1/chat/completions")[0] == 405


def long_story(url) -> dict:
    """A streamed completion that runs long: a story's opening, 480 tokens."""
    return {"model": name(url), "prompt": STORY, "max_tokens": 480, "temperature": 0, "stream": True}


STORY = "Once upon a time, in a small village by the sea, there lived"


def wait_idle(url) -> dict:
    """``/health`` once no request runs or waits (within 30 s)."""
    deadline = time.monotonic() + 30
    while (h := health(url))["running"] or h["waiting"]:
        assert time.monotonic() < deadline, f"requests still run: {h}"
        time.sleep(0.1)
    return h


def test_a_client_leaving_mid_stream_frees_its_slot(server):
    whole = client(server).completions.create(**{**long_story(server), "stream": False})
    assert whole.usage.completion_tokens > 300  # what the request runs to, unless left
    steps = health(server)["steps"]
    with streaming(server, "/v1/completions", long_story(server)) as lines:
        for line in lines:
            if line.startswith("data: ") and '"text": ""' not in line:
                break  # one piece read, then gone
    wait_idle(server)
    assert health(server)["steps"] - steps < 50  # it left long before the end
    assert chat(server, max_tokens=4).choices[0].message.content


def test_concurrent_clients_each_get_what_they_get_alone(server):
    alone = [chat(server, [{"role": "user", "content": p}], max_tokens=24).choices[0].message.content
             for p in PROMPTS]
    together, generated = [None] * len(PROMPTS), [0] * len(PROMPTS)

    def ask(i):
        r = chat(server, [{"role": "user", "content": PROMPTS[i]}], max_tokens=24)
        together[i], generated[i] = r.choices[0].message.content, r.usage.completion_tokens

    before = wait_idle(server)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == alone
    h = health(server)
    assert h["widest"] >= 2  # they shared steps
    assert h["steps"] > before["steps"] and h["step_seconds"] > before["step_seconds"]
    # a request's first token comes from its prefill, each later one from a step fed the one before
    assert h["stepped"] - before["stepped"] == sum(n - 1 for n in generated)


def test_a_conversations_next_turn_feeds_only_what_is_new(model):
    """A finished request's cache is kept with what it holds: the next turn of the conversation (which resends it
    all) finds its start there and feeds only the rest, as the ``openai`` client's ``cached_tokens`` reads; the
    answers are those of a server that kept nothing."""
    with serving(model, max_batch=1) as url:
        first = chat(url, max_tokens=16)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        chat_turns = [*QUESTION, {"role": "assistant", "content": first.choices[0].message.content},
                      {"role": "user", "content": "And of Germany?"}]
        before = health(url)
        second = chat(url, chat_turns, max_tokens=16)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
        after = health(url)
        assert after["reused"] - before["reused"] == cached
        assert after["prefilled"] - before["prefilled"] == second.usage.prompt_tokens - cached
        again = chat(url, chat_turns, max_tokens=16)  # all but the prompt's last token held
        assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
        other = client(url).completions.create(model=name(url), prompt="Zebras", max_tokens=4, temperature=0)
        assert other.usage.prompt_tokens_details.cached_tokens == 0  # (nothing in common: the one cache reused)
    with serving(model, max_batch=1) as url:
        fresh = chat(url, chat_turns, max_tokens=16)
        assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].message.content == again.choices[0].message.content == fresh.choices[0].message.content
    assert second.usage.completion_tokens == fresh.usage.completion_tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A small random model (its greedy text rarely ends early) with a context of 1024."""
    from tmac.models.family.llama import LlamaConfig
    from tmac.models.files.synthetic import write_random_gguf

    path = str(tmp_path_factory.mktemp("tiny") / "m.gguf")
    cfg = LlamaConfig(vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, context_length=1024)
    write_random_gguf(path, cfg, "Q4_0")
    return tmac.load_model(path, context=1024, progress=False)


def until(condition, seconds=60):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def greedy(max_tokens):
    from tmac.models.run.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0)


LONG_PROMPT = [i % 250 + 1 for i in range(10 * 64 + 5)]  # (PREFILL_BUDGET is 64: 11 pieces)


def test_a_long_prompt_is_prefilled_between_the_running_requests_steps(tiny):
    """A prompt of many ``PREFILL_BUDGET``s is fed a budget at a time, the running request stepped after each piece:
    it goes on generating while the prompt is prefilled, and both get the tokens a session gives each alone."""
    from tmac.models.run.batching import PREFILL_BUDGET, Batcher
    from tmac.models.run.batching import Request as Generation

    assert len(LONG_PROMPT) > 10 * PREFILL_BUDGET
    short = [5, 6, 7]
    alone = [list(tmac.Session(tiny).generate(p, max_new_tokens=n, ignore_eos=True, temperature=0))
             for p, n in ((short, 200), (LONG_PROMPT, 4))]
    seen, finished = {}, threading.Event()

    def emit(piece, end, logprobs):  # (the long prompt's first token: how far the running request got meanwhile)
        seen.setdefault("running", len(running.ids))
        if end is not None:
            finished.set()

    batcher = Batcher(tiny, max_batch=2)
    try:
        running = Generation(short, greedy(200), lambda piece, end, logprobs: None)
        batcher.submit(running)
        until(lambda: len(running.ids) >= 3)
        before = len(running.ids)
        prompt = Generation(LONG_PROMPT, greedy(4), emit)
        batcher.submit(prompt)
        assert finished.wait(120)
        until(lambda: not batcher.load()["running"])
    finally:
        batcher.close()
    assert seen["running"] - before >= 10  # a step after each of the prompt's 11 pieces but the last
    assert seen["running"] < 200  # (it was still running)
    stops = tiny.tokenizer.stop_ids
    assert running.ids == alone[0][:len(running.ids)] and (len(running.ids) == 200 or running.ids[-1] in stops)
    assert prompt.ids == alone[1][:len(prompt.ids)] and len(prompt.ids) >= 1


def test_a_request_cancelled_while_prefilled_leaves_what_it_fed_for_the_next(tiny):
    """Cancelled between two pieces of its prompt, a request leaves without a word; its cache keeps the pieces fed,
    and the next request with that prompt starts from them and gets the session's tokens."""
    from tmac.models.run.batching import PREFILL_BUDGET, Batcher
    from tmac.models.run.batching import Request as Generation

    alone = list(tmac.Session(tiny).generate(LONG_PROMPT, max_new_tokens=4, ignore_eos=True, temperature=0))
    said, done = [], threading.Event()
    batcher = Batcher(tiny, max_batch=2)
    try:
        # (so that the prompt goes in pieces)
        running = Generation([5, 6, 7], greedy(400), lambda piece, end, logprobs: None)
        batcher.submit(running)
        until(lambda: len(running.ids) >= 1)
        left = Generation(LONG_PROMPT, greedy(4), lambda piece, end, logprobs: said.append((piece, end)))
        batcher.submit(left)
        until(lambda: batcher.prefilled >= 3 + 2 * PREFILL_BUDGET)
        left.cancel()
        until(lambda: not batcher.load()["prefilling"])
        fed = batcher.prefilled - 3
        again = Generation(LONG_PROMPT, greedy(4), lambda piece, end, logprobs: done.set() if end is not None else None)
        batcher.submit(again)
        assert done.wait(120)
        running.cancel()
    finally:
        batcher.close()
    assert said == [] and not left.ids and 2 * PREFILL_BUDGET <= fed < len(LONG_PROMPT)
    assert again.cached == fed and again.ids == alone[:len(again.ids)]


def test_an_api_key_is_required_when_set(model):
    with serving(model, api_key="sesame") as url:
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").models.list()
        status, _, answer = call(url, "POST", "/v1/chat/completions", {"model": "x", "messages": QUESTION})
        assert status == 401 and answer["error"]["code"] == "invalid_api_key"
        assert call(url, "GET", "/health")[0] == 200
        assert call(url, "GET", "/v1/models", headers={"Authorization": "bearer sesame"})[0] == 200  # any case
        assert call(url, "GET", "/v1/models", headers={"Authorization": "Bearer sesame2"})[0] == 401
        assert client(url, "sesame").chat.completions.create(model=model_name(model.source), messages=QUESTION,
                                                             max_tokens=4).choices[0].message.content
        pieces = client(url, "sesame").completions.create(model=model_name(model.source), prompt="Once", max_tokens=4,
                                                          stream=True)
        assert [c.choices[0].finish_reason for c in pieces][-1] in ("stop", "length")


def test_a_full_queue_answers_503_with_retry_after(model):
    with serving(model, max_batch=1, max_queue=0) as url:
        with streaming(url, "/v1/completions", long_story(url)) as first:
            next(first)
            status, headers, answer = call(url, "POST", "/v1/chat/completions",
                                           {"model": name(url), "messages": QUESTION})
            assert status == 503 and headers["retry-after"] and answer["error"]["code"] == "busy"


def test_forward_rows_gives_each_row_what_a_one_row_forward_gives(model):
    """One step for several sequences at once (each projection once for all the rows) — the batcher's path for a
    model without a decode plan — equals each sequence's own step, bit for bit."""
    import torch

    from tmac.models.run.sequence import Sequence

    prompts = [[1, 2, 3, 4, 5], [10, 20, 30], [7, 8, 9, 10, 11, 12, 13]]
    new = [42, 43, 44]
    with torch.inference_mode():
        batched, alone = [Sequence(model, 64, adopt=False) for _ in prompts], []
        for p, s in zip(prompts, batched):
            model(torch.tensor(p), 0, cache=s)
        rows = model.forward_rows(torch.tensor(new), [len(p) for p in prompts], batched)
        for p, t in zip(prompts, new):
            s = Sequence(model, 64, adopt=False)
            model(torch.tensor(p), 0, cache=s)
            alone.append(model(torch.tensor([t]), len(p), last_only=True, cache=s)[0])
    assert torch.equal(rows, torch.stack(alone))
    with pytest.raises(ValueError, match="outside a sequence's context"):
        model.forward_rows(torch.tensor([1]), [64], batched[:1])


@pytest.mark.parametrize("extreme", [dict(temperature=1e308, top_k=5), dict(temperature=1e-300, top_p=0.5),
                                     dict(top_p=1e-320), dict(repeat_penalty=5e-324), dict(repeat_penalty=1e300),
                                     dict(temperature=2.0, min_p=1.0), dict(frequency_penalty=2, presence_penalty=-2)])
def test_sampling_values_at_their_bounds_answer(server, extreme):
    body = {"model": name(server), "prompt": "Once upon a time", "max_tokens": 4, **extreme}
    status, _, answer = call(server, "POST", "/v1/completions", body)
    assert status == 200 and answer["usage"]["completion_tokens"] >= 1, answer


def test_a_body_past_the_limit_is_413_and_the_server_goes_on(model):
    with serving(model, max_body=4096) as url:
        big = {"model": "m", "prompt": "x " * 4000, "max_tokens": 1}
        status, _, answer = call(url, "POST", "/v1/completions", big)
        assert status == 413 and answer["error"]["code"] == "request_too_large"
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)  # chunked: no Content-Length to refuse by
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        payload = json.dumps(big).encode()
        for i in range(0, len(payload), 1000):
            piece = payload[i:i + 1000]
            conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
        conn.send(b"0\r\n\r\n")
        assert conn.getresponse().status == 413
        conn.close()
        assert call(url, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 200
