"""Decode speed of several models, interleaved in one run: how fast each family decodes beside llama on the same
bytes (files from ``bench/make_synthetic_gguf.py --family``).

Rounds go model 1, model 2, … and again, so a slower stretch of a shared host hits all; each round is a fresh
process running ``tmac run --json`` (greedy, ``--ignore-eos``, a fixed token count) with the given threads, after a
warm-up run of each (its kernels compile there). The first model is the reference of the ratio column.

Run: ``python bench/compare_models.py A.gguf B.gguf … [--rounds 5] [--tokens 64] [--threads 1] [--json]``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

PROMPT = "Tell me a story about a lighthouse keeper."


def run(model: str, tokens: int, threads: int) -> dict:
    env = dict(os.environ, TMAC_NUM_THREADS=str(threads))
    r = subprocess.run([sys.executable, "-m", "tmac", "run", model, "-p", PROMPT, "-n", str(tokens), "--ignore-eos",
                        "--no-chat", "--json"], capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(f"tmac run {model} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    for m in args.models:
        run(m, 4, args.threads)
    speeds: dict[str, list[float]] = {m: [] for m in args.models}
    for i in range(args.rounds):
        for m in args.models:
            speeds[m].append(run(m, args.tokens, args.threads)["gen_tokens_per_s"])
        print(f"round {i + 1}/{args.rounds}: " + ", ".join(f"{os.path.basename(m)} {s[-1]:.1f}"
                                                          for m, s in speeds.items()), file=sys.stderr)
    med = {m: statistics.median(s) for m, s in speeds.items()}
    ref = med[args.models[0]]
    if args.json:
        print(json.dumps({"threads": args.threads, "tokens": args.tokens, "rounds": args.rounds,
                          "median_tok_s": med, "ratio": {m: v / ref for m, v in med.items()}}))
    else:
        width = max(len(os.path.basename(m)) for m in args.models)
        print(f"{'model':{width}} {'decode tok/s':>13} {'min':>7} {'max':>7} {'ratio':>6}")
        for m, s in speeds.items():
            print(f"{os.path.basename(m):{width}} {med[m]:13.1f} {min(s):7.1f} {max(s):7.1f} {med[m] / ref:6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
