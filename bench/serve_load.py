"""Concurrent clients against ``tmac serve``: aggregate generated tok/s, per-request latency p50/p95, time to first
token and errors, at each concurrency level; and, from the server's ``/health``, the tokens a second of its decode
steps alone (what batching gives, each request's prefill apart).

Starts ``tmac serve MODEL`` on a free loopback port (``--threads``), waits for ``/health``, then for each level N
runs N clients at once, each sending ``--rounds`` streamed completions one after another (greedy, ``--tokens`` at
most, a different story opening each), through the official ``openai`` client; every request has a timeout, so a
run ends by itself. The server stops at the end.

Run: ``python bench/serve_load.py [MODEL] [--levels 1,2,4,8] [--rounds 2] [--tokens 64] [--threads 1] [--json]``.
``--url URL`` measures a server already running there instead, the same way.

``--peer PATH`` also starts llama.cpp's own ``llama-server`` (built by ``bench/llama_cpp_tools.py``) on the same
GGUF with the same threads, continuous batching and as many slots as the highest level (``-np N -cb``), and measures
the two in turns, level by level (``--turns`` times each; the best aggregate counts): the table gains tmac's ratio
to it. Every answer is greedy, so each opening's text at every level is checked against its text with the server
idle: the ``same`` column counts the requests whose text equals their prompt's answer alone in the server.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
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
    return launch(args, port, "tmac serve")


def start_llama_server(program: str, model: str, port: int, threads: int, slots: int) -> subprocess.Popen:
    args = [program, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb", str(threads),
            "-np", str(slots), "-cb", "-c", str(1024 * slots), "--no-webui"]
    return launch(args, port, "llama-server")


def launch(args: list[str], port: int, name: str) -> subprocess.Popen:
    """Start a server whose log goes to a file (a pipe nobody reads would stall a chatty one) and wait for it."""
    log = tempfile.TemporaryFile(mode="w+")
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            raise SystemExit(f"{name} exited:\n{log.read()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
        except OSError:
            time.sleep(0.5)
        else:
            return server
    server.kill()
    raise SystemExit(f"{name} did not answer /health within 10 minutes")


def one_request(client, model: str, prompt: str, tokens: int) -> dict:
    t0 = time.perf_counter()
    first, generated, pieces, text = None, None, 0, []
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, timeout=300)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            pieces += 1
            text.append(chunk.choices[0].text)
            if first is None:
                first = time.perf_counter() - t0
        if chunk.usage is not None:
            generated = chunk.usage.completion_tokens
    if generated is None:  # a server that does not report usage in streams: a piece a token, as they send them
        generated = pieces
    return {"latency": time.perf_counter() - t0, "ttft": first if first is not None else float("nan"),
            "tokens": generated, "prompt": prompt, "text": "".join(text)}


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
            "ttft_p50_s": statistics.median(r["ttft"] for r in results) if results else float("nan"),
            "answers": [(r["prompt"], r["text"]) for r in results]}


class Server:
    """One server under load: its name, base URL, client and model id, and its process where this script started
    it."""

    def __init__(self, name: str, base: str, process: subprocess.Popen | None = None):
        import openai

        self.name, self.base, self.process = name, base, process
        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        self.model = self.client.models.list().data[0].id
        one_request(self.client, self.model, OPENINGS[0], 4)  # warm-up: the plans and kernels load here

    def alone(self, tokens: int) -> dict[str, str]:
        """Each opening's greedy answer with no other request in the server: what batching must not change."""
        return {prompt: one_request(self.client, self.model, prompt, tokens)["text"] for prompt in OPENINGS}

    def run(self, clients: int, rounds: int, tokens: int) -> dict:
        return level(self.client, self.base, self.model, clients, rounds, tokens)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(30)


def unchanged(row: dict, alone: dict[str, str]) -> int:
    """How many of ``row``'s answers equal the answer their prompt got alone."""
    return sum(alone[prompt] == text for prompt, text in row["answers"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None, help="as tmac serve takes it (default: the default model)")
    p.add_argument("--levels", default="1,2,4,8", help="concurrent clients, comma-separated (default 1,2,4,8)")
    p.add_argument("--rounds", type=int, default=2, help="requests each client sends in turn (default 2)")
    p.add_argument("--tokens", type=int, default=64, help="max_tokens of each request (default 64)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--url", help="an OpenAI-compatible server already running (its base, without /v1)")
    p.add_argument("--peer", metavar="PATH",
                   help="llama.cpp's llama-server program, measured in turns on the same file")
    p.add_argument("--turns", type=int, default=1, help="with --peer: each level measured this many times each")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    levels = [int(x) for x in args.levels.split(",")]
    if not levels or min(levels) < 1 or max(levels) > 64 or not 1 <= args.rounds <= 100 or not 1 <= args.tokens <= 1024:
        raise SystemExit("levels 1..64, rounds 1..100, tokens 1..1024")
    if args.peer and (args.url or not os.access(args.peer, os.X_OK)):
        raise SystemExit("--peer takes an executable llama-server, and not with --url")
    if not 1 <= args.turns <= 20:
        raise SystemExit("turns 1..20")
    servers: list[Server] = []
    try:
        if args.url:
            servers.append(Server("server", args.url))
        else:
            port = free_port()
            servers.append(Server("tmac", f"http://127.0.0.1:{port}",
                                  start_server(args.model, port, args.threads, max(levels))))
        if args.peer:
            from tmac.models.files.load import default_model_path

            port = free_port()
            path = args.model or default_model_path()  # a GGUF's path: llama-server reads no other
            servers.append(Server("llama-server", f"http://127.0.0.1:{port}",
                                  start_llama_server(args.peer, path, port, args.threads, max(levels))))
        rows: dict[str, list[dict]] = {s.name: [] for s in servers}
        alone = {s.name: s.alone(args.tokens) for s in servers}
        for n in levels:
            best: dict[str, dict] = {}
            for _ in range(args.turns):
                for server in servers:
                    row = server.run(n, args.rounds, args.tokens)
                    if server.name not in best or row["aggregate_tok_s"] > best[server.name]["aggregate_tok_s"]:
                        best[server.name] = row
                    print(f"{server.name}, {n} clients: {row['aggregate_tok_s']:.1f} tok/s", file=sys.stderr)
            for name, row in best.items():
                rows[name].append(row)
    finally:
        for server in servers:
            server.stop()
    for name, table in rows.items():
        for row in table:
            row["unchanged"] = unchanged(row, alone[name])
    if args.json:
        print(json.dumps({"model": servers[0].model, "threads": args.threads, "tokens": args.tokens,
                          "rounds": args.rounds, "turns": args.turns, "servers": rows}))
        return 0
    print(f"{servers[0].model}, {args.threads} thread(s), {args.tokens} tokens a request, {args.rounds} requests a "
          f"client{f', best of {args.turns} turns' if args.peer else ''}")
    print("(steps: the decode steps' tokens a second, prefills left out, from tmac's /health; same: answers equal "
          "to the prompt's answer alone in the server)")
    peer = rows.get("llama-server")
    for name, table in rows.items():
        print(f"\n{name}")
        print(f"{'clients':>7} {'tok/s':>8} {'vs 1':>6} {'steps':>8} {'vs 1':>6} {'p50 s':>7} {'p95 s':>7} "
              f"{'TTFT s':>7} {'same':>7} {'errors':>6}" + (" vs llama-server" if peer and name != "llama-server"
                                                             else ""))
        first = table[0]
        for i, r in enumerate(table):
            ratio = f" {r['aggregate_tok_s'] / peer[i]['aggregate_tok_s']:16.2f}" if peer and table is not peer else ""
            rate = r["aggregate_tok_s"]
            print(f"{r['clients']:7d} {rate:8.1f} {rate / first['aggregate_tok_s']:6.2f} "
                  f"{r['step_tok_s']:8.1f} {r['step_tok_s'] / first['step_tok_s']:6.2f} "
                  f"{r['latency_p50_s']:7.2f} {r['latency_p95_s']:7.2f} {r['ttft_p50_s']:7.2f} "
                  f"{r['unchanged']:3d}/{r['requests']:<3d} {r['errors']:6d}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
