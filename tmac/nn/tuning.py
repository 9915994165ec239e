"""``tmac tune``: grid-search the kernels' tiling (row block, unroll, K chunk, GEMM row tile) per ISA, bit width, K
and group, measured in this process; results persist in the kernel cache directory (``tuning.json``) and every
later ``spec_for_format`` without explicit tiling uses them.

Candidates are timed cold, as a model's weights stream from DRAM (a single cache-resident matrix favours other
tilings: K chunks lose there and gain cold), and together (``tmac.base.timing.cold_medians``), so a slower stretch of
the shared host hits them alike. First the GEMV's block rows × unroll, then its K chunks at the best of those, on
one activation row, table build included; a winner other than the default then meets the default once more in a
pass of their own (stages run apart, and a noisy host can favour either); then the GEMM row tile on ``GEMM_ROWS``
rows. Weights are random; timing does not depend on their values.
"""

from __future__ import annotations


from tmac.quant.choose import key, save_tiling, spec_for_format

GEMM_ROWS = 16
MARGIN = 0.03  # a tiling replaces the default only when it is this much faster: timings of one tiling vary ~1-3 %


def candidates(spec) -> list[dict]:
    """Block rows × unroll to try for a ``KernelSpec``'s parameters."""
    blocks = [spec.vector_bytes * f for f in (1, 2, 4, 8) if spec.vector_bytes * f <= 512]
    return [{"block_rows": b, "unroll": u} for b in blocks for u in sorted(spec.unrolls())]


def chunk_candidates(spec) -> list[int]:
    """K chunks to try: the default, and all of K cut into 1, 2, 4, 8 or 16 near-equal chunks."""
    unit, units = spec.chunk_unit, spec.k_padded // spec.chunk_unit
    return sorted({spec.k_chunk} | {-(-units // n) * unit for n in (1, 2, 4, 8, 16) if n <= units})


def kernels_timed(defaults) -> int:
    """How many tilings ``tune`` times for these default specs (its progress total): block rows × unroll, K chunks
    (one off where the best block's default chunk is not among the defaults'), the final pass of two, GEMM tiles."""
    return len(candidates(defaults)) + len(chunk_candidates(defaults)) + 2 + 3


def tune(fmt, k: int, isa, m: int = 4096, progress=None) -> tuple[dict, dict[str, list[tuple[dict, float]]]]:
    """Best tiling for weights of format ``fmt`` with ``k`` inputs on ``isa`` (this machine's), persisted; returns
    it and every (tiling, seconds) measured, by kernel (``"gemv"``, ``"gemm"``)."""
    import numpy as np
    import torch

    from tmac.execution.lut_ops import LutWeight
    from tmac.execution.packing import pack
    from tmac.quant.quantize import quantize_weight

    w = np.random.default_rng(0).standard_normal((m, k), dtype=np.float32)
    qw = quantize_weight(w, bits=fmt.bits, group_size=fmt.group_size, symmetric=not fmt.has_zeros,
                         ternary=fmt.ternary)
    x1, xn = torch.randn(1, k), torch.randn(GEMM_ROWS, k)
    measured = {"gemv": [], "gemm": []}

    def timed(tilings: list[dict], x) -> list[tuple[dict, float]]:
        weights = []
        for tiling in tilings:
            weights.append(LutWeight(pack(qw, spec_for_format(qw.format, k, isa, **tiling))))
            weights[-1].matmul(x)  # compiles (progress on stderr) outside the timing
            if progress:
                progress.advance(" ".join(f"{f}={v}" for f, v in tiling.items()))
        runs = [({**t, "k_chunk": w.spec.k_chunk}, sec)  # the default's value where it was 0
                for t, w, sec in zip(tilings, weights, cold_seconds(weights, x))]
        measured["gemv" if x is x1 else "gemm"].extend(runs)
        return runs

    def fastest(runs: list[tuple[dict, float]], default: dict) -> dict:
        """The fastest tiling of ``runs``, unless ``default`` (one of them) is within ``MARGIN`` of it: noise."""
        tiling, sec = min(runs, key=lambda ts: ts[1])
        return default if any(t == default and s <= sec * (1 + MARGIN) for t, s in runs) else tiling

    defaults = spec_for_format(qw.format, k, isa, unroll=0)
    default = {f: getattr(defaults, f) for f in ("block_rows", "unroll", "k_chunk")}
    best = fastest(timed(candidates(defaults), x1), default)
    chunks = chunk_candidates(spec_for_format(qw.format, k, isa, **best))
    best = fastest(timed([{**best, "k_chunk": c} for c in chunks], x1), best)
    if best != default:  # the two stages timed them in different passes: they meet once more, in one pass
        best = fastest(timed([default, best], x1), default)
    best = fastest(timed([{**best, "n_tile": n} for n in (2, 4, 8)], xn), {**best, "n_tile": defaults.n_tile})
    spec = spec_for_format(qw.format, k, isa, **best)
    save_tiling(key(isa.name, fmt.bits, k, spec.group_size, spec.lut_group, spec.has_zeros, spec.triples,
                    bool(spec.codebook)), best)
    return best, measured


def cold_seconds(weights: list, x) -> list[float]:
    """Median seconds of ``w.matmul(x)`` for each of ``weights``, cold and timed together (``cold_medians``)."""
    import torch

    from tmac.base.timing import cold_medians

    out = torch.empty(x.shape[0], weights[0].m)
    return cold_medians([(w.copies, lambda c: c.matmul(x, out=out), w.nbytes) for w in weights])
