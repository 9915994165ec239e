"""Instructions one call of a NEON kernel executes under qemu-aarch64, for the tilings given: the evidence behind the
arm64 default tilings (docs/decisions.md, "Block rows" and "NEON's pair sums"), measured without a board.

    python bench/arm64_tilings.py --types Q2_K Q6_K --tilings default block_rows=16 unroll=2 --rows 1 4 64

Each type's 2048 × 2048 matrix (random blocks of that GGUF type) is packed for each tiling, its kernel
cross-compiled for ``--isa`` and run by tmac's C harness (tmac/harness/run_kernels.c) on one thread under ``qemu-aarch64
-cpu CPU`` with the counting plugin of bench/arm64_counts.py: one call's instructions are those of three calls less
one, halved (the process's start and the harness's reads cancel). 1 row: ``lut_gemv``; more: ``build_tables`` then
``lut_gemm`` (a prompt's lookups; where the spec has dot products a prompt of 16 rows or more takes those instead).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from arm64_counts import plugin, read_counts  # noqa: E402

CPUS = {"neon_dotprod": "cortex-a76", "neon": "cortex-a72"}
FIELDS = ("block_rows", "unroll", "n_tile", "k_chunk")


def weight(kind: str, rng, m: int, k: int):
    import gguf

    from tmac.models.files.synthetic import k_quant_blocks
    from tmac.quant.quantize import import_gguf

    if kind.endswith("_K") or kind.startswith("IQ"):  # (random blocks; the i-quants' too)
        return import_gguf(k_quant_blocks(rng, m, k, kind), kind, (m, k))
    x = (rng.standard_normal((m, k)) * 0.02).astype(np.float32)
    return import_gguf(gguf.quants.quantize(x, getattr(gguf.GGMLQuantizationType, kind)), kind, (m, k))


def tiling_of(text: str) -> dict:
    if text == "default":
        return {}
    out = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name not in FIELDS or not value.isdigit():
            raise SystemExit(f"--tilings: {part!r} is not FIELD=N with FIELD one of {', '.join(FIELDS)}")
        out[name] = int(value)
    return out


def harness(work: str) -> str:
    import tvm_ffi.libinfo

    out = os.path.join(work, "run_kernels")
    source = os.path.join(REPO, "tmac", "harness", "run_kernels.c")
    if not os.path.exists(out) or os.path.getmtime(out) < os.path.getmtime(source):
        subprocess.run(["aarch64-linux-gnu-gcc", "-O2", "-rdynamic", "-I", tvm_ffi.libinfo.find_include_path(),
                        source, "-o", out, "-ldl", "-lpthread"], check=True)
    return out


def tensor(d: str, name: str, a: np.ndarray) -> str:
    a.tofile(os.path.join(d, name + ".bin"))
    return f"{name} {a.dtype} {a.ndim} {' '.join(map(str, a.shape))}"


def count(cpu: str, so: str, run: str, lib: str, d: str, calls: list[str]) -> int:
    with open(os.path.join(d, "calls.txt"), "w") as f:
        f.write("\n".join(calls) + "\n")
    out = os.path.join(d, "counts.txt")
    subprocess.run(["qemu-aarch64", "-cpu", cpu, "-plugin", f"{so},out={out}", "-L", "/usr/aarch64-linux-gnu", run, lib,
                    d], check=True, capture_output=True, env={**os.environ, "TMAC_NUM_THREADS": "1"})
    return sum(insns * runs for _, insns, runs in read_counts(out))


def calls_of(spec, d: str, weights: list[str], x: np.ndarray, m: int) -> list[str]:
    n, k = x.shape
    rows = spec.padded_rows(n) if n > 1 else 1
    tables = [f"{name} {dtype} {len(shape)} {' '.join(map(str, shape))}" for name, dtype, shape in
              zip(("lut", "ls", "xs"), ("int8", "float32", "float32"), spec.table_shapes(rows))]
    y = f"y float32 2 {n} {m}"
    if n == 1:
        return [f"lut_gemv {len(weights) + 5}", tensor(d, "x", x), *weights, *tables, y]
    padded = np.vstack([x, np.zeros((rows - n, k), np.float32)])
    return ["build_tables 4", tensor(d, "x", padded), *tables, f"lut_gemm {len(weights) + 4}", *weights, *tables, y]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", nargs="+", default=["Q2_K", "Q4_K", "Q6_K", "Q4_0"], help="GGUF types")
    ap.add_argument("--tilings", nargs="+", default=["default"], help="'default' or FIELD=N[,FIELD=N] (FIELD: "
                    + ", ".join(FIELDS) + ")")
    ap.add_argument("--rows", nargs="+", type=int, default=[1], help="activation rows a call")
    ap.add_argument("--isa", choices=sorted(CPUS), default="neon_dotprod")
    ap.add_argument("--work", help="where kernels and counts go (default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tilings = [(text, tiling_of(text)) for text in args.tilings]

    from tmac.codegen.build import build_library
    from tmac.execution.packing import pack
    from tmac.kernels import ISAS
    from tmac.quant.choose import spec_for

    isa, cpu = ISAS[args.isa], CPUS[args.isa]
    work = args.work or tempfile.mkdtemp(prefix="arm64-tilings-")
    so, run = plugin(work), harness(work)
    m = k = 2048
    results = []
    if not args.json:
        print(f"{'type':8} {'tiling':24} {'kernel':62} {'rows':>4} {'M instructions a call':>22}")
    for kind in args.types:
        qw = weight(kind, np.random.default_rng(0), m, k)
        for i, (text, tiling) in enumerate(tilings):
            try:
                spec = spec_for(qw, isa, **tiling)
            except ValueError as e:  # a tiling this type's spec cannot take (unroll past its lut group's steps)
                if not args.json:
                    print(f"{kind:8} {text:24} {str(e)}", flush=True)
                continue
            d = os.path.join(work, f"{kind}-{i}")
            os.makedirs(d, exist_ok=True)
            lib = os.path.join(d, "kernel.so")
            build_library(spec, isa, lib)
            packed = pack(qw, spec)
            weights = [tensor(d, "w", packed.weights), tensor(d, "s", packed.scales)] + \
                ([tensor(d, "z", packed.zeros)] if packed.zeros is not None else [])
            for n in args.rows:
                x = np.random.default_rng(1).standard_normal((n, k)).astype(np.float32)
                calls = calls_of(spec, d, weights, x, m)
                once, thrice = count(cpu, so, run, lib, d, calls), count(cpu, so, run, lib, d, calls * 3)
                row = {"type": kind, "tiling": text, "kernel": spec.name, "rows": n, "instructions": (thrice - once) / 2}
                results.append(row)
                if not args.json:
                    print(f"{kind:8} {text:24} {spec.name:62} {n:>4} {row['instructions'] / 1e6:>22.3f}", flush=True)
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
