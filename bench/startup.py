"""Start-up of ``tmac run`` against llama.cpp (llama-cpp-python) on the same GGUF, in turns: seconds from the
process's start to the imports done, the model loaded, the kernels ready and the first token.

tmac's rows: the first run with an empty kernel cache, the first run with the kernels compiled (its packed copy
written, and its plans' recipe), the second run (the copy mapped, its plans replayed without torch), the same with
torch (``TMAC_RECIPES=0``: the copy loaded as a model), and a ``.tmac`` file from ``tmac convert``. llama.cpp's: a fresh process
each time (the file in the page cache, as for tmac's later runs). Each process is a fresh one; the rounds alternate.

Run: ``python bench/startup.py MODEL.gguf [--threads 1] [--rounds 3] [--json]`` (llama.cpp: the ``peer`` extra).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

PROMPT = "Write one sentence about the sea."

LLAMA_CPP = r"""
import json, sys, time
def since_start():
    with open("/proc/self/stat") as f:
        start = int(f.read().rpartition(")")[2].split()[19])
    with open("/proc/uptime") as f:
        up = float(f.read().split()[0])
    import os
    return up - start / os.sysconf("SC_CLK_TCK")
from llama_cpp import Llama
imported = since_start()
llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=512, verbose=False)
loaded = since_start()
first = None
for piece in llm(sys.argv[3], max_tokens=16, temperature=0, stream=True):
    first = first or since_start()
print(json.dumps({"import_s": imported, "load_s": loaded - imported, "first_token_s": first}))
"""


def environment(**extra) -> dict:
    """The environment of each process: as a user's, whose Python keeps compiled modules (``__pycache__``)."""
    env = dict(os.environ, **extra)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def tmac_run(model: str, cache: str, threads: int, env_extra=None) -> dict:
    env = environment(TMAC_CACHE_DIR=cache, **(env_extra or {}))
    # (--no-chat: the prompt's text alone, as llama-cpp-python's completion below feeds it, not in a chat template)
    r = subprocess.run([sys.executable, "-m", "tmac", "run", model, "-p", PROMPT, "-n", "16", "--temperature",
                        "0", "--json", "--threads", str(threads), "--no-chat"], capture_output=True, text=True,
                       env=env)
    if r.returncode:
        raise SystemExit(f"tmac run failed:\n{r.stderr[-2000:]}")
    d = json.loads(r.stdout)
    return {k: d[k] for k in ("import_s", "load_s", "setup_s", "first_token_s")}


def llama_cpp_run(model: str, threads: int) -> dict | None:
    r = subprocess.run([sys.executable, "-c", LLAMA_CPP, model, str(threads), PROMPT], capture_output=True, text=True,
                       env=environment())
    if r.returncode:
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as d:
        converted = os.path.join(d, "model.tmac")
        for i in range(args.rounds):
            cache = os.path.join(d, f"cache{i}")
            rows.setdefault("tmac, first run, no kernels", []).append(tmac_run(args.model, cache, args.threads))
            shutil.rmtree(os.path.join(cache, "models"))
            rows.setdefault("tmac, first run", []).append(tmac_run(args.model, cache, args.threads))
            rows.setdefault("tmac, second run", []).append(tmac_run(args.model, cache, args.threads))
            rows.setdefault("tmac, second run with torch", []).append(
                tmac_run(args.model, cache, args.threads, {"TMAC_RECIPES": "0"}))
            if i == 0:
                subprocess.run([sys.executable, "-m", "tmac.apps.cli", "convert", args.model, "-o", converted],
                               capture_output=True, env=dict(os.environ, TMAC_CACHE_DIR=cache), check=True)
            rows.setdefault("tmac, .tmac file", []).append(tmac_run(converted, cache, args.threads))
            peer = llama_cpp_run(args.model, args.threads)
            if peer is not None:
                rows.setdefault("llama.cpp", []).append(peer)
            print(f"round {i + 1}/{args.rounds} done", file=sys.stderr)
    table = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in rows.items()}
    if args.json:
        print(json.dumps({"model": args.model, "threads": args.threads, "medians": table}))
        return 0
    print(f"{os.path.basename(args.model)}, {args.threads} thread(s), medians of {args.rounds} fresh processes "
          f"(seconds from the process's start for import and first token):")
    print(f"{'':<30} {'import':>7} {'load':>7} {'kernels':>8} {'first token':>12}")
    for name, v in table.items():
        kernels = f"{v['setup_s']:.2f}" if "setup_s" in v else "—"
        print(f"{name:<30} {v['import_s']:7.2f} {v['load_s']:7.2f} {kernels:>8} {v['first_token_s']:12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
