"""Concurrent clients against ``tmac serve``: aggregate generated tok/s, per-request latency p50/p95, time to first
token and errors, at each concurrency level; and, from the server's ``/health``, the tokens a second of its decode
steps alone (what batching gives, each request's prefill apart).

Starts ``tmac serve MODEL`` on a free loopback port (``--threads``), waits for ``/health``, then for each level N
runs N clients at once, each sending ``--rounds`` streamed completions one after another (greedy, ``--tokens`` at
most, a different story opening each), through the official ``openai`` client; every request has a timeout, so a
run ends by itself. The server stops at the end.

Run: ``python bench/serve_load.py [MODEL] [--levels 1,2,4,8] [--rounds 2] [--tokens 64] [--threads 1] [--json]``.
``--url URL`` measures a server already running there instead (llama.cpp's: ``python -m llama_cpp.server --model
FILE --n_threads 1 --port 8081``, from the ``peer`` extra with its ``server`` dependencies), the same way.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

OPENINGS = ["Once upon a time, in a small village by the sea,", "The old lighthouse keeper climbed the stairs and",
            "In the year 2150, the first colony on Mars", "The recipe for the perfect loaf of bread begins with",
            "Deep in the forest, a fox and a crow", "The history of the printing press starts in",
            "On a cold winter morning, the train to the north", "A letter arrived for the mayor, and it said"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, port: int, threads: int, max_batch: int) -> subprocess.Popen:
    args = [sys.executable, "-m", "tmac", "serve", *([model] if model else []), "--port", str(port), "--threads",
            str(threads), "--max-batch", str(max_batch), "--context", "1024"]
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"tmac serve exited:\n{server.stderr.read()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
            return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit("tmac serve did not answer /health within 10 minutes")


def one_request(client, model: str, prompt: str, tokens: int) -> dict:
    t0 = time.perf_counter()
    first, generated, pieces = None, None, 0
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, timeout=300)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            pieces += 1
            if first is None:
                first = time.perf_counter() - t0
        if chunk.usage is not None:
            generated = chunk.usage.completion_tokens
    if generated is None:  # a server that does not report usage in streams: a piece a token, as they send them
        generated = pieces
    return {"latency": time.perf_counter() - t0, "ttft": first if first is not None else float("nan"),
            "tokens": generated}


def health(base: str) -> dict:
    """The server's ``/health`` (tmac's counts its decode steps' tokens and seconds; another server's may not)."""
    try:
        return json.loads(urllib.request.urlopen(f"{base}/health", timeout=5).read())
    except (OSError, ValueError):
        return {}


def level(client, base: str, model: str, clients: int, rounds: int, tokens: int) -> dict:
    results, errors = [], []

    def run(i: int) -> None:
        for r in range(rounds):
            try:
                results.append(one_request(client, model, OPENINGS[(i + r * clients) % len(OPENINGS)], tokens))
            except Exception as e:  # counted, the run goes on
                errors.append(f"{type(e).__name__}: {e}")

    before = health(base)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = health(base)
    # the decode steps alone (each sequence's token a step; the prompts' prefills apart): what batching gives
    spent = after.get("step_seconds", 0.0) - before.get("step_seconds", 0.0)
    step_rate = (after["stepped"] - before["stepped"]) / spent if "stepped" in before and spent > 0 else float("nan")
    lat = sorted(r["latency"] for r in results) or [float("nan")]
    return {"clients": clients, "requests": len(results), "errors": len(errors), "first_error": errors[:1],
            "aggregate_tok_s": sum(r["tokens"] for r in results) / wall, "step_tok_s": step_rate,
            "latency_p50_s": statistics.median(lat), "latency_p95_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))],
            "ttft_p50_s": statistics.median(r["ttft"] for r in results) if results else float("nan")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None, help="as tmac serve takes it (default: the default model)")
    p.add_argument("--levels", default="1,2,4,8", help="concurrent clients, comma-separated (default 1,2,4,8)")
    p.add_argument("--rounds", type=int, default=2, help="requests each client sends in turn (default 2)")
    p.add_argument("--tokens", type=int, default=64, help="max_tokens of each request (default 64)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--url", help="an OpenAI-compatible server already running (its base, without /v1)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    import openai

    levels = [int(x) for x in args.levels.split(",")]
    if not levels or min(levels) < 1 or max(levels) > 64 or not 1 <= args.rounds <= 100 or not 1 <= args.tokens <= 1024:
        raise SystemExit("levels 1..64, rounds 1..100, tokens 1..1024")
    port = free_port()
    server = None if args.url else start_server(args.model, port, args.threads, max(levels))
    try:
        base = args.url or f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        one_request(client, model, OPENINGS[0], 4)  # warm-up: the plans and kernels load here
        rows = []
        for n in levels:
            rows.append(level(client, base, model, n, args.rounds, args.tokens))
            print(f"{n} clients: {rows[-1]['aggregate_tok_s']:.1f} tok/s", file=sys.stderr)
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
    first = rows[0]
    if args.json:
        print(json.dumps({"model": model, "threads": args.threads, "tokens": args.tokens, "rounds": args.rounds,
                          "levels": rows}))
        return 0
    print(f"{model}, {args.threads} thread(s), {args.tokens} tokens a request, {args.rounds} requests a client")
    print("(steps: the decode steps' tokens a second, prefills left out; from a tmac server's /health)")
    print(f"{'clients':>7} {'tok/s':>8} {'vs 1':>6} {'steps':>8} {'vs 1':>6} {'p50 s':>7} {'p95 s':>7} {'TTFT s':>7} "
          f"{'errors':>6}")
    for r in rows:
        print(f"{r['clients']:7d} {r['aggregate_tok_s']:8.1f} {r['aggregate_tok_s'] / first['aggregate_tok_s']:6.2f} "
              f"{r['step_tok_s']:8.1f} {r['step_tok_s'] / first['step_tok_s']:6.2f} "
              f"{r['latency_p50_s']:7.2f} {r['latency_p95_s']:7.2f} {r['ttft_p50_s']:7.2f} {r['errors']:6d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
