"""GEMV: tmac W1-W4 and ternary against torch fp32, bf16, int4 and int8 weight-only, warm and cold, 1 and 2 threads; groups
of 128 weights (64 where K is not a multiple of 128).

warm: one matrix, weights cache-resident. cold: cycle through enough copies (≥ 1 GiB in all) that weights
stream from DRAM, the regime of real models. Every candidate's copies, and the bandwidth probe, lie in huge pages,
as a model's weights do once tmac loads them (tmac.base.memory). Run: `make bench` (or pytest bench -k 4096x4096
--threads 1).
"""
import pytest
import torch

from baselines import COLD_BYTES, bench_group, int4_linear, int4pack, random_weights
from conftest import BYTES, RESULTS, record
from tmac import quantize_weight
from tmac.base.timing import cold_medians_beside_probe, read_probe
from tmac.execution.lut_ops import LutWeight
from tmac.base.memory import huge_page_copies

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (3200, 8640), (8640, 3200)]


def _candidates(m, k):
    """name → (make n weight copies, call with (copy, x), bytes per copy)."""
    w = random_weights(m, k)
    x = torch.randn(1, k)
    xb = x.to(torch.bfloat16)
    group = bench_group(k)
    # outputs preallocated where the op takes one, as a model's decode step holds its buffers (a fresh output costs
    # 5-15 µs a cold call: its allocator's code and lines are evicted by the weight stream)
    y, yb = torch.empty(1, m), torch.empty(1, m, dtype=torch.bfloat16)
    out = {
        "torch fp32": (lambda n: huge_page_copies((w,), n), lambda c: torch.mm(x, c[0].t(), out=y), m * k * 4),
        "torch bf16": (lambda n: huge_page_copies((w.to(torch.bfloat16),), n),
                       lambda c: torch.mm(xb, c[0].t(), out=yb), m * k * 2),
        "torch int4wo": (lambda n: huge_page_copies(int4pack(w, group), n),
                         lambda c: int4_linear(xb, c, group), m * k // 2 + m * k // group * 4),
    }
    s8 = w.abs().amax(1) / 127
    w8 = (w / s8[:, None]).round().to(torch.int8)
    out["torch int8wo"] = (lambda n: huge_page_copies((w8, s8), n),
                           lambda c: torch.ops.aten._weight_int8pack_mm(x, c[0], c[1]), m * k + m * 4)
    formats = {f"tmac W{bits}": dict(bits=bits, group_size=group) for bits in (1, 2, 3, 4)}
    formats["tmac ternary"] = dict(ternary=True, group_size="tensor")  # BitNet b1.58 (triples where choose.uses_triples)
    for name, fmt in formats.items():
        lw = LutWeight.from_quantized(quantize_weight(w.numpy(), **fmt))
        lw.matmul(x)  # compile / load outside the timing
        out[name] = (lw.copies, lambda c: c.matmul(x, out=y), lw.nbytes)
    return out


_CACHE = {}


@pytest.mark.parametrize("regime", ["warm", "cold"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("cand", ["torch fp32", "torch bf16", "torch int4wo", "torch int8wo",
                                  "tmac W1", "tmac W2", "tmac W3", "tmac W4", "tmac ternary"])
def test_gemv(benchmark, set_threads, regime, shape, cand):
    if shape not in _CACHE:
        _CACHE.clear()
        _CACHE[shape] = _candidates(*shape)
    make, call, nbytes = _CACHE[shape][cand]
    copies = make(1 if regime == "warm" else max(2, COLD_BYTES // nbytes))
    state = {"i": 0}

    def step():
        c = copies[state["i"] % len(copies)]
        state["i"] += 1
        return call(c)

    benchmark.group = f"{regime} {set_threads}t {shape}"
    benchmark.pedantic(step, rounds=30 if regime == "warm" else 10, iterations=len(copies) if regime == "cold" else 20,
                       warmup_rounds=1)
    BYTES[(shape, cand)] = nbytes
    record(benchmark, (regime, set_threads, shape, cand))


# tmac's own layouts only: right after a cold torch fp32 GEMV a tmac one ran up to 1.7x slower (4096x4096 W1 0.094 ->
# 0.163 ms; after torch's int4 kernel 0.101), which the decode path never sees
INTERLEAVED = ["tmac W1", "tmac W2", "tmac W3", "tmac W4", "tmac ternary"]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gemv_cold_interleaved(set_threads, shape):
    """The cold candidates of a shape timed together (``cold_medians``: each one's copies called in turn, 1 GiB
    in all) with the read probe before every pass, so ratios and shares of the probe hold even as the shared
    host's bandwidth drifts between the one-at-a-time benchmarks above."""
    if shape not in _CACHE:
        _CACHE.clear()
        _CACHE[shape] = _candidates(*shape)
    seconds, probe_sec = cold_medians_beside_probe([_CACHE[shape][c] for c in INTERLEAVED])
    key = ("cold interleaved", set_threads, shape)
    for cand, sec in zip(INTERLEAVED, seconds):
        BYTES[(shape, cand)] = _CACHE[shape][cand][2]
        RESULTS[(*key, cand)] = sec
    BYTES[(shape, "read 1 GiB")] = COLD_BYTES
    RESULTS[(*key, "read 1 GiB")] = probe_sec
    assert all(sec > 0 for sec in seconds)


def test_dram_bandwidth(benchmark, set_threads):
    """What the hardware can stream: a sum over 1 GiB (one read per byte)."""
    buf = read_probe()
    benchmark.group = f"bandwidth {set_threads}t"
    benchmark.pedantic(lambda: buf.sum(), rounds=5, iterations=1, warmup_rounds=1)
    BYTES[("dram", "read 1 GiB")] = COLD_BYTES
    record(benchmark, ("bandwidth", set_threads, "dram", "read 1 GiB"))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("how", ["GEMM", "looped GEMV"])
def test_gemm_vs_looped_gemv(benchmark, set_threads, bits, how):
    """16 activation rows at 4096x4096: one GEMM call (each weight load reused across a tile of rows) against
    16 GEMV calls — the GEMM must win, or prefill would be better off calling GEMV."""
    w = random_weights(4096, 4096)
    lw = LutWeight.from_quantized(quantize_weight(w.numpy(), bits=bits, group_size=128))
    x = torch.randn(16, 4096)
    rows = [x[i:i + 1].clone() for i in range(16)]
    call = (lambda: lw.matmul(x)) if how == "GEMM" else (lambda: [lw.matmul(r) for r in rows])
    call()
    benchmark.group = f"gemm {set_threads}t W{bits}"
    benchmark.pedantic(call, rounds=20, iterations=5, warmup_rounds=1)
    record(benchmark, ("warm", set_threads, "GEMM 16x4096x4096", f"tmac W{bits} {how}"))
