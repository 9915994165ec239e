"""The dot-product GEMM against the table-lookup GEMM on the same packed weights: one process, the two kernels'
calls in turns (``TMAC_DOT_ROWS`` picks the path), the best of each over ``--rounds`` turns.

    python bench/dot_vs_lut.py [--isa avx2] [--rows 16,32,256] [--shape 2048x2048] [--types Q4_K,Q6_K,w4g32]

Types: llama.cpp's K-quants and i-quants (random blocks, ``k_quant_blocks``), or ``w<bits>g<group>[-sym]``
(``quantize_weight``; ``-sym``: no zeros, as Q4_0).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from tmac import quantize_weight
from tmac.execution.lut_ops import DOT_ROWS_ENV, LutWeight
from tmac.kernels import best_isa


def weight(kind: str, m: int, k: int, rng):
    if kind.endswith("_K") or kind.startswith("IQ"):
        from tmac.models.files.synthetic import k_quant_blocks
        from tmac.quant.quantize import import_gguf

        return import_gguf(k_quant_blocks(rng, m, k, kind), kind, (m, k))
    bits, group = kind[1:].removesuffix("-sym").split("g")
    return quantize_weight(rng.standard_normal((m, k)).astype(np.float32), bits=int(bits),
                           group_size="row" if group == "row" else int(group), symmetric=kind.endswith("-sym"))


def best_of(call, calls: int) -> float:
    best = float("inf")
    for _ in range(calls):
        t = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isa", default=best_isa().name)
    ap.add_argument("--rows", default="16,32,256")
    ap.add_argument("--shape", default="2048x2048", help="MxK")
    ap.add_argument("--types", default="Q4_K,Q6_K,Q3_K,Q2_K")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m, k = (int(v) for v in args.shape.lower().split("x"))
    rng = np.random.default_rng(0)
    rows_out = []
    for kind in args.types.split(","):
        lw = LutWeight.from_quantized(weight(kind, m, k, rng), isa=args.isa)
        for n in (int(v) for v in args.rows.split(",")):
            x, y = torch.randn(n, k), torch.empty(n, m)
            times = {"dot": float("inf"), "lut": float("inf")}
            for _ in range(args.rounds):
                for path, value in (("dot", "1"), ("lut", "0")):
                    os.environ[DOT_ROWS_ENV] = value
                    lw.matmul(x, out=y)  # (the path's kernels and buffers ready)
                    times[path] = min(times[path], best_of(lambda: lw.matmul(x, out=y), 2))
            os.environ.pop(DOT_ROWS_ENV)
            rows_out.append({"type": kind, "isa": args.isa, "rows": n, "shape": [m, k],
                             "dot_ms": times["dot"] * 1e3, "lut_ms": times["lut"] * 1e3,
                             "dot_gmacs": n * m * k / times["dot"] / 1e9, "lut_gmacs": n * m * k / times["lut"] / 1e9,
                             "ratio": times["lut"] / times["dot"]})
    if args.json:
        print(json.dumps(rows_out, indent=1))
        return
    print(f"{'type':8s} {'ISA':12s} {'rows':>5s} {'dot ms':>8s} {'LUT ms':>8s} {'dot GMAC/s':>10s} {'LUT GMAC/s':>10s}"
          f" {'dot/LUT speed':>13s}")
    for r in rows_out:
        print(f"{r['type']:8s} {r['isa']:12s} {r['rows']:5d} {r['dot_ms']:8.2f} {r['lut_ms']:8.2f} "
              f"{r['dot_gmacs']:10.1f} {r['lut_gmacs']:10.1f} {r['ratio']:12.2f}x")


if __name__ == "__main__":
    main()
