"""Vectors in TIR: index ramps (``vec``, for every generator), and for the decode glue's floats lane counts and
spans that cover a length, folds across lanes and loops, and e^x without libm."""

from __future__ import annotations

F32 = "float32"


def lanes_of(n: int, widest: int) -> int:
    """The widest power of two up to ``widest`` lanes that divides ``n``."""
    lanes = widest
    while n % lanes:
        lanes //= 2
    return lanes


def spans_of(n: int, widest: int) -> list[tuple[int, int]]:
    """(offset, lanes) vectors covering ``n`` floats: full ``widest``-lane vectors, then a power-of-two tail."""
    spans, at = [], 0
    lanes = widest
    while at < n:
        while lanes > n - at:
            lanes //= 2
        spans.append((at, lanes))
        at += lanes
    return spans


def fold(v, lanes: int, op):
    """One value from the ``lanes`` lanes of ``v``, halving with shuffles."""
    from tvm import tirx

    while lanes > 1:
        half = lanes // 2
        v = op(tirx.Shuffle([v], list(range(half))), tirx.Shuffle([v], list(range(half, lanes))))
        lanes = half
    return v


def f32(value: float):
    from tvm import tirx

    return tirx.FloatImm(F32, value)


def constant(values, dtype: str = F32):
    """A vector of these lanes, ``dtype`` each (LLVM folds the shuffle of broadcasts into one constant)."""
    from tvm import tirx

    imm = tirx.FloatImm if dtype.startswith("float") else tirx.IntImm
    distinct = sorted(set(values))
    sources = [tirx.Broadcast(imm(dtype, v), len(values)) for v in distinct]
    return tirx.Shuffle(sources, [distinct.index(v) * len(values) + i for i, v in enumerate(values)])


def bcast(value, lanes: int):
    from tvm import tirx

    return value if lanes == 1 else tirx.Broadcast(value, lanes)


def exp(x, lanes: int):
    """e^x in float32 without libm, which LLVM would call once per lane: 2^n·p(r) with n = round(x·log2 e),
    r = x − n·ln 2 (|r| ≤ ½ln 2, ln 2 split in two so r is exact to float32), p the Taylor polynomial of degree 7 (truncation error r^8/8! < 6e-9 relative). x is
    clamped to [−87, 88]: 2^n stays a normal float, so e^x saturates to ≈ 1.6e-38 and 1.7e38 outside."""
    from tvm import tirx

    def c(v):
        return bcast(f32(v), lanes)

    x = tirx.min(tirx.max(x, c(-87.0)), c(88.0))
    n = tirx.floor(x * c(1.4426950408889634) + c(0.5))
    r = (x - n * c(0.693145751953125)) - n * c(1.4286068203094172e-06)
    p = c(1.0 / 5040)
    for k in (720, 120, 24, 6, 2, 1, 1):
        p = p * r + c(1.0 / k)
    i32 = "int32" if lanes == 1 else f"int32x{lanes}"
    two_n = tirx.reinterpret(F32 if lanes == 1 else f"float32x{lanes}",
                             (tirx.Cast(i32, n) + bcast(tirx.IntImm("int32", 127), lanes))
                             << bcast(tirx.IntImm("int32", 23), lanes))
    return p * two_n


def vec(start, lanes: int):
    """The indices ``start .. start + lanes − 1`` (one lane: ``start`` itself)."""
    from tvm import tirx

    return tirx.Ramp(start, 1, lanes) if lanes > 1 else start


def lane_fold(T, n, lanes: int, op, term, init: float = 0.0, start=0):
    """``op`` folded over ``term(at)`` for the whole vectors ``at`` from ``start`` (a multiple of ``lanes``) up to
    ``n`` (both may be runtime values), starting from ``init``: per lane in a loop, then across lanes. ``term`` may
    also emit stores, which land inside the loop."""
    acc = T.alloc_buffer((lanes,), F32, scope="global")
    T.buffer_store(acc, bcast(f32(init), lanes), [vec(0, lanes)])
    with T.serial(start // lanes, n // lanes) as c:
        T.buffer_store(acc, op(acc[vec(0, lanes)], term(vec(c * lanes, lanes))), [vec(0, lanes)])
    return fold(acc[vec(0, lanes)], lanes, op)


def rms_scale(T, n: int, lanes: int, square, eps):
    """A one-float buffer holding RMSNorm's ``1 / √(mean(x²) + eps)`` over ``n`` floats, ``square(at)`` giving
    ``x²`` of the vector at ``at`` (it may also emit stores, as ``lane_fold``'s ``term``)."""
    from tvm import tirx

    scale = T.alloc_buffer((1,), F32, scope="global")
    total = lane_fold(T, n, lanes, lambda a, b: a + b, square)
    T.buffer_store(scale, f32(1.0) / tirx.sqrt(total / f32(float(n)) + eps), [0])
    return scale
