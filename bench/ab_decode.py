"""Decode speed of two tmac installs, interleaved in one run: does a change leave generation as fast as it was?

Each install is a directory tmac is installed in (``pip install --no-deps --target DIR .`` from a checkout of each
commit) with its own kernel cache (it compiles its kernels once, before the timing). Rounds alternate A, B, A, B …
so a slower stretch of a shared host hits both; each round is a fresh process running ``tmac run --json``
(greedy, ``--ignore-eos``, a fixed token count) on the default model (or ``--model FILE``) with the given threads.

With ``--steps`` a round times the decode step alone instead: the median of 300 ``DecodePlan.step`` calls after
a short generation, in a fresh process (no start-up, prefill or sampling in the figure).

Run: ``python bench/ab_decode.py DIR_A DIR_B [--model FILE] [--rounds 7] [--tokens 128] [--threads 1] [--steps]
[--json]``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


PROMPT = "Tell me a story about a lighthouse keeper."


def _python(site: str, cache: str, threads: int, args: list[str], what: str) -> str:
    """Standard output of ``python -P ARGS`` importing tmac from ``site``, with its own kernel cache."""
    env = dict(os.environ, PYTHONPATH=site, TMAC_CACHE_DIR=cache, TMAC_NUM_THREADS=str(threads))
    r = subprocess.run([sys.executable, "-P", *args], capture_output=True, text=True, env=env,
                       cwd=tempfile.gettempdir())
    if r.returncode:
        raise SystemExit(f"{what} from {site} failed:\n{r.stderr[-2000:]}")
    return r.stdout


def run(site: str, cache: str, tokens: int, threads: int, model: str | None) -> dict:
    args = ["-m", "tmac", "run", *([model] if model else []), "-p", PROMPT, "-n", str(tokens), "--ignore-eos",
            "--json", "--temperature", "0"]
    return json.loads(_python(site, cache, threads, args, "tmac run"))


STEPS = f"""
import statistics, sys, time, torch, tmac
try:
    from tmac.models.files.load import default_model_path
except ImportError:  # (an install from before models/ was split by concern)
    from tmac.models.load import default_model_path
PROMPT = {PROMPT!r}
model = tmac.load_model(sys.argv[1] if len(sys.argv) > 1 else default_model_path())
session = tmac.Session(model)
ids = model.tokenizer.encode(PROMPT)
session.generate(ids, max_new_tokens=4, temperature=0)
plan, pos, times = session.decode_plan(), len(ids) + 4, []
with torch.inference_mode():  # (as generation steps: a token table read in Python writes the plan's input row)
    for i in range(300):
        t = time.perf_counter()
        plan.step(42, pos + i)
        times.append(time.perf_counter() - t)
print(1 / statistics.median(times))
"""


def run_steps(site: str, cache: str, threads: int, model: str | None) -> float:
    """Decode steps a second (the median step) of ``site``'s plan, in a fresh process."""
    return float(_python(site, cache, threads, ["-c", STEPS, *([model] if model else [])],
                         "the decode steps").split()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--model", help="a model file (default: the default model)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", action="store_true", help="time DecodePlan.step alone (steps/s), not tmac run")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    sites = {"A": os.path.abspath(args.a), "B": os.path.abspath(args.b)}
    model = os.path.abspath(args.model) if args.model else None
    caches = {k: tempfile.mkdtemp(prefix=f"tmac-ab-{k}-") for k in sites}
    outputs = {}
    for k in sites:  # warm-up: kernels compile here, outside the timing
        outputs[k] = run(sites[k], caches[k], 8, args.threads, model)["generated_ids"]
    speeds = {k: [] for k in sites}
    for i in range(args.rounds):
        for k in sites:
            speeds[k].append(run_steps(sites[k], caches[k], args.threads, model) if args.steps else
                             run(sites[k], caches[k], args.tokens, args.threads, model)["gen_tokens_per_s"])
        print(f"round {i + 1}/{args.rounds}: " + ", ".join(f"{k} {s[-1]:.1f}" for k, s in speeds.items()),
              file=sys.stderr)
    med = {k: statistics.median(s) for k, s in speeds.items()}
    result = {"threads": args.threads, "tokens": None if args.steps else args.tokens, "rounds": args.rounds,
              "measure": "decode steps/s" if args.steps else "tmac run decode tok/s",
              "median_tok_s": med, "b_over_a": med["B"] / med["A"], "same_first_tokens": outputs["A"] == outputs["B"],
              "sites": sites, "model": model}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{'install':8} {'steps/s' if args.steps else 'decode tok/s':>14} (median) {'min':>7} {'max':>7}")
        for k, s in speeds.items():
            print(f"{k:8} {med[k]:23.1f} {min(s):7.1f} {max(s):7.1f}")
        print(f"B / A = {result['b_over_a']:.3f}; first 8 greedy tokens identical: {result['same_first_tokens']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
