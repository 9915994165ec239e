"""``tmac tune``: grid-search the kernels' tiling (row block, unroll, GEMM row tile) per ISA, bit width, K and
group, measured in this process; results persist in the kernel cache directory (``tuning.json``) and every later
``spec_for_format`` without explicit tiling uses them.

The GEMV candidates (block rows × unroll) are timed on one activation row, table build included; the GEMM row
tile on ``GEMM_ROWS`` rows with the winning block. Weights are random; timing does not depend on their values.
"""

from __future__ import annotations

import functools
import json
import os

GEMM_ROWS = 16
TILE_FIELDS = ("block_rows", "unroll", "n_tile")


def tuning_file() -> str:
    from .runtime import cache_dir

    return os.path.join(cache_dir(), "tuning.json")


def key(isa: str, bits: int, k: int, group: int, lut_group: int, has_zeros: bool, triples: bool = False) -> str:
    return f"{isa}|b{bits}|k{k}|g{group}|lg{lut_group}|{'z' if has_zeros else 's'}" + ("|t3" if triples else "")


@functools.lru_cache(maxsize=1)
def _table(path: str) -> dict:
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(table, dict):
        return {}
    return {k: v for k, v in table.items() if isinstance(v, dict) and set(v) == set(TILE_FIELDS)
            and all(type(v[f]) is int and v[f] > 0 for f in TILE_FIELDS)}


def tuned_tiling(isa: str, bits: int, k: int, group: int, lut_group: int, has_zeros: bool,
                 triples: bool = False) -> dict:
    """The persisted tiling for these kernel parameters ({} when never tuned, or the cache is unreadable)."""
    try:
        path = tuning_file()
    except Exception:  # no apache-tvm installed: no cache, no tuning
        return {}
    return dict(_table(path).get(key(isa, bits, k, group, lut_group, has_zeros, triples), {}))


def candidates(spec) -> list[dict]:
    """Block rows × unroll to try for a ``KernelSpec``'s parameters."""
    blocks = [spec.vector_bytes * f for f in (1, 2, 4, 8) if spec.vector_bytes * f <= 512]
    return [{"block_rows": b, "unroll": u} for b in blocks for u in sorted(spec.unrolls())]


def tune(fmt, k: int, isa, m: int = 4096, progress=None) -> tuple[dict, list[tuple[dict, float]]]:
    """Best tiling for weights of format ``fmt`` with ``k`` inputs on ``isa`` (this machine's), persisted; returns
    it and every (tiling, seconds) measured."""
    import numpy as np
    import torch

    from .bench import median_seconds
    from .lut_ops import LutWeight
    from .packing import pack, spec_for_format
    from .quantize import quantize_weight

    w = np.random.default_rng(0).standard_normal((m, k), dtype=np.float32)
    qw = quantize_weight(w, bits=fmt.bits, group_size=fmt.group_size, symmetric=not fmt.has_zeros,
                         ternary=fmt.ternary)
    x1, xn = torch.randn(1, k), torch.randn(GEMM_ROWS, k)
    measured = []

    def timed(tiling: dict, x) -> float:
        lw = LutWeight(pack(qw, spec_for_format(qw.format, k, isa, **tiling)))
        lw.matmul(x)  # compiles (progress on stderr) outside the timing
        sec = median_seconds(lambda: lw.matmul(x))
        measured.append((tiling, sec))
        if progress:
            progress.advance(" ".join(f"{f}={v}" for f, v in tiling.items()))
        return sec

    spec0 = spec_for_format(qw.format, k, isa, block_rows=isa.vector_bytes)
    best = min(candidates(spec0), key=lambda t: timed({**t, "n_tile": 4}, x1))
    best = {**best, "n_tile": min((2, 4, 8), key=lambda n: timed({**best, "n_tile": n}, xn))}
    spec = spec_for_format(qw.format, k, isa, **best)
    save(key(isa.name, fmt.bits, k, spec.group_size, spec.lut_group, spec.has_zeros, spec.triples), best)
    return best, measured


def save(entry_key: str, tiling: dict) -> None:
    path = tuning_file()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    table = dict(_table(path))
    table[entry_key] = tiling
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    _table.cache_clear()
