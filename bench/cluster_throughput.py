"""Aggregate generation throughput of ``tmac serve --ray`` (R replicas x T threads) against one ``tmac serve`` (R x T
threads), the same clients: C concurrent clients, each asking for N tokens (greedy, past the end-of-text token)
with prompts of its own, for a few rounds; the two in turns.

    python bench/cluster_throughput.py [MODEL] --replicas 2 --threads 1 --clients 8 --tokens 64 --rounds 2 [--json]

Prints a table: per round and setup, answered requests, generated tokens, seconds, aggregate tok/s.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

TOPICS = ["a lighthouse", "a dragon", "the sea", "a robot", "a garden", "a train", "the moon", "a violin", "a forest",
          "a city", "a clock", "a mountain", "a river", "a cat", "a library", "a storm"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, seconds: float = 600) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the server did not start")


def _drive(url: str, clients: int, tokens: int) -> dict:
    """``clients`` concurrent completions of ``tokens`` tokens each: answered, tokens, seconds."""
    done, failed = [], []

    def ask(i):
        body = json.dumps({"prompt": f"Tell me a story about {TOPICS[i % len(TOPICS)]}.", "max_tokens": tokens,
                           "temperature": 0, "ignore_eos": True}).encode()
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=600) as r:
                done.append(json.loads(r.read())["usage"]["completion_tokens"])
        except OSError as e:
            failed.append(str(e))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    return {"answered": len(done), "failed": len(failed), "tokens": sum(done), "seconds": seconds,
            "tok_s": sum(done) / seconds}


def _serve(args, ray: bool) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    threads = args.threads if ray else args.threads * args.replicas
    cmd = [sys.executable, "-m", "tmac", "serve", *([args.model] if args.model else []), "--port", str(port),
           "--threads", str(threads), "-c", str(args.context), "--max-batch", str(args.clients)]
    if ray:
        cmd += ["--ray", "--replicas", str(args.replicas), "--max-batch", str(args.clients)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RAY_ADDRESS": ""} if ray else None)
    url = f"http://127.0.0.1:{port}"
    _wait(url, proc)
    return proc, url


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="per replica; the single server gets replicas x threads")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = []
    for round_ in range(args.rounds):
        for ray in (False, True):
            label = f"ray {args.replicas}x{args.threads}" if ray else f"tmac serve x{args.replicas * args.threads}"
            print(f"round {round_ + 1}: {label} ...", file=sys.stderr, flush=True)
            proc, url = _serve(args, ray)
            try:
                _drive(url, min(args.clients, 2), 4)  # warm: kernels, caches
                rows.append({"round": round_ + 1, "setup": label, **_drive(url, args.clients, args.tokens)})
            finally:
                proc.send_signal(2)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'round':>5}  {'setup':<16} {'answered':>8} {'tokens':>7} {'seconds':>8} {'tok/s':>7}")
    for r in rows:
        print(f"{r['round']:>5}  {r['setup']:<16} {r['answered']:>8} {r['tokens']:>7} {r['seconds']:>8.2f} "
              f"{r['tok_s']:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
