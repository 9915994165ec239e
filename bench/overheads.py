"""The fixed costs three design choices avoid, each against the alternative, timed in turns in one run:

- ``tmac.Linear`` called eagerly (the checked function directly) against the registered custom op
  ``tmac::lut_linear`` (the dispatcher), on a 64×64 4-bit layer, 1 thread;
- ``plan_key`` (is the decode plan still valid?) against building the plan again, on the default model;
- tmac's GGUF reader against ``gguf.GGUFReader`` opening the default model (each in a fresh process, the median of
  three).

Run: ``python bench/overheads.py [--json]``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

OPEN_GGUF = {
    "tmac": "from tmac.models.files.gguf_file import GGUFFile; GGUFFile(path)",
    "gguf.GGUFReader": "import gguf; gguf.GGUFReader(path)",
}


def open_once(reader: str, path: str) -> float:
    """Seconds of one open of ``path`` by ``reader`` in a fresh process, its modules imported before the clock."""
    code = (f"import gguf, sys, time, tmac.models.files.gguf_file\npath = sys.argv[1]\nt = time.perf_counter()\n"
            f"{OPEN_GGUF[reader]}\nprint(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, check=True).stdout
    return float(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("TMAC_NUM_THREADS", "1")
    import torch

    import tmac
    from tmac.nn.linear import lut_linear_op
    from tmac.models.run import decode
    from tmac.models.files.load import default_model_path
    from tmac.base.timing import warm_medians

    rows = []
    layer = tmac.Linear.from_float(torch.nn.Linear(64, 64, bias=False), bits=4, group_size=32)
    x = torch.randn(1, 64)
    with torch.inference_mode():
        eager, op = warm_medians([lambda: layer(x), lambda: lut_linear_op(
            x, layer.qweight, layer.scales, layer.zeros, None, layer._spec_json, 64, "")], min_seconds=1.0)
    rows.append(("tmac.Linear 64×64 W4, a call", "eager (direct)", eager * 1e6, "custom op", op * 1e6, "µs"))

    path = default_model_path()
    model = tmac.load_model(path)
    session = tmac.Session(model)
    session.generate(model.tokenizer.encode("Hello"), max_new_tokens=2)
    key, build = warm_medians([lambda: decode.plan_key(model), lambda: decode.DecodePlan.build(model)])
    rows.append(("decode plan", "plan_key", key * 1e3, "build", build * 1e3, "ms"))

    opened = {reader: [] for reader in OPEN_GGUF}
    for _ in range(3):  # in turns
        for reader, times in opened.items():
            times.append(open_once(reader, path))
    (a, ta), (b, tb) = ((r, sorted(t)[1]) for r, t in opened.items())
    rows.append(("open the default GGUF", a, ta, b, tb, "s"))

    if args.json:
        print(json.dumps([dict(zip(("what", "a", "a_value", "b", "b_value", "unit"), r)) for r in rows], indent=1))
        return 0
    for what, a, va, b, vb, unit in rows:
        ratio = f"×{vb / va:.1f}" if va > 0 else ""
        print(f"{what:44} {a:>16} {va:>8.2f} {unit:3}   {b:>16} {vb:>8.2f} {unit:3}  {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
