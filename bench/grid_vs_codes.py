"""A grid i-quant held as its grid indices and sign bits, expanded in the kernel (``GridQuads``), against the same
weights as 4-bit codebook codes: one process, the two layouts' calls in turns, the best of each over ``--rounds``.

    python bench/grid_vs_codes.py [--rows 1,4,64] [--shapes 2048x2048,8192x2048,2048x8192] [--json]

Random IQ2_XXS blocks (``k_quant_blocks``), on an ISA that expands grids (AVX-512 VBMI). The matrices are small
enough to stay in cache: this times the kernels' work, not the weights' stream from memory (``tmac bench --e2e``).
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from dot_vs_lut import best_of, weight
from tmac.execution.lut_ops import LutWeight
from tmac.execution.packing import pack
from tmac.kernels import best_isa
from tmac.quant.choose import spec_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isa", default=best_isa().name)
    ap.add_argument("--type", default="IQ2_XXS")
    ap.add_argument("--rows", default="1,4,64")
    ap.add_argument("--shapes", default="2048x2048,8192x2048,2048x8192", help="MxK,...")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from tmac.kernels import ISAS

    isa = ISAS[args.isa]
    if not isa.expands_grids:
        raise SystemExit(f"{isa.name} does not expand grids (AVX-512 VBMI does)")
    rng = np.random.default_rng(0)
    out = []
    for shape in args.shapes.split(","):
        m, k = (int(v) for v in shape.lower().split("x"))
        qw = weight(args.type, m, k, rng)
        layouts = {"grid": LutWeight(pack(qw, spec_for(qw, isa))),
                   "codes": LutWeight(pack(qw, spec_for(qw, isa, grid="")))}
        for n in (int(v) for v in args.rows.split(",")):
            x, y = torch.randn(n, k), torch.empty(n, m)
            calls = max(2, 2000 // (n * max(1, m * k >> 20)))
            times = dict.fromkeys(layouts, float("inf"))
            for _ in range(args.rounds):
                for name, lw in layouts.items():
                    lw.matmul(x, out=y)
                    times[name] = min(times[name], best_of(lambda: lw.matmul(x, out=y), calls))
            out.append({"type": args.type, "isa": isa.name, "shape": [m, k], "rows": n, "grid_ms": times["grid"] * 1e3,
                        "codes_ms": times["codes"] * 1e3, "grid_speed": times["codes"] / times["grid"],
                        "grid_bytes": layouts["grid"].weights.nbytes, "codes_bytes": layouts["codes"].weights.nbytes})
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{'type':8s} {'shape':>10s} {'rows':>5s} {'grid ms':>8s} {'codes ms':>9s} {'grid speed':>10s} "
          f"{'weight bytes':>13s}")
    for r in out:
        print(f"{r['type']:8s} {'x'.join(map(str, r['shape'])):>10s} {r['rows']:5d} {r['grid_ms']:8.3f} "
              f"{r['codes_ms']:9.3f} {r['grid_speed']:9.2f}x {r['grid_bytes'] / r['codes_bytes']:12.2f}x")


if __name__ == "__main__":
    main()
