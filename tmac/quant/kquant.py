"""llama.cpp's K-quant parameters factored back into what the files store: per weight group a byte multiplier, per
super group a float scale (``factor_params``). Kernels then stream a byte per scale and zero instead of a float."""

from __future__ import annotations

import numpy as np

from tmac.base.qweight import QuantizedWeight

FACTOR_PARAMS = 1 << 21  # parameters factored at a time: the int64 temporaries stay small beside a large head's


def factor_params(qw: QuantizedWeight, super_groups: int | None = None):
    """K-quant parameters as multipliers and super scales: ``((a, d), (b, m))`` with uint8 ``a, b [M, G]`` and
    float32 ``d, m [M, G/SG]`` (float16 values where any are: ``super_dtype``) such that, in float32, scale = d·a
    and zero = m·b − offset·scale exactly (the kernels' arithmetic); without zeros ``((a, d), None)`` with int8
    ``a``; None where the parameters do not factor so. SG: the format's super group, in groups. Row slices of
    ``FACTOR_PARAMS`` parameters keep the int64 temporaries small beside a 49152-row head's."""
    fmt = qw.format
    sg = super_groups or fmt.groups_per_super
    if qw.factors is not None and sg == fmt.groups_per_super:  # as the file stores them
        return qw.factors
    m, g = qw.scales.shape
    if g % sg:
        return None
    zeros = qw.zeros is not None
    a, d = np.empty((m, g), np.uint8 if zeros else np.int8), np.empty((m, g // sg), np.float32)
    b, mn = (np.empty((m, g), np.uint8), np.empty((m, g // sg), np.float32)) if zeros else (None, None)
    rows = max(1, FACTOR_PARAMS // (8 * g))
    for r0 in range(0, m, rows):
        s = qw.scales[r0:r0 + rows].astype(np.float64)
        n = len(s)
        z = qw.zeros[r0:r0 + rows].astype(np.float64) if zeros else None
        params = (s, z + fmt.offset * s) if zeros else (s,)  # the scale, and m·b: llama.cpp's min
        if not all(np.array_equal(p.astype(np.float32), p) for p in params):
            return None
        factors = [_common_factor(p.reshape(-1, sg), signed=not zeros) for p in params]
        if any(f is None for f in factors):
            return None
        (a_s, d_s), *zero_factors = ((mult.reshape(n, g), base.reshape(n, g // sg)) for mult, base in factors)
        s32 = np.repeat(d_s, sg, axis=1) * a_s.astype(np.float32)
        if not np.array_equal(s32, s.astype(np.float32)):
            return None
        a[r0:r0 + n], d[r0:r0 + n] = a_s, d_s
        if zeros:
            (b_s, m_s), = zero_factors
            z32 = np.repeat(m_s, sg, axis=1) * b_s.astype(np.float32) - np.float32(fmt.offset) * s32
            if not np.array_equal(z32, z.astype(np.float32)):
                return None
            b[r0:r0 + n], mn[r0:r0 + n] = b_s, m_s
    return (a, d), ((b, mn) if zeros else None)


def _common_factor(v: np.ndarray, signed: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """``v [R, n]`` (float32) as ``mult [R, n]`` uint8 (``signed``: int8) times ``base [R, 1]`` float32, exactly,
    with the largest base that is a float16 value (the gcd of each row's values over the least odd divisor that
    shortens it to float16's 11 bits, as far as the multipliers allow), else the largest (the gcd); None where no
    such pair exists."""
    bits = np.ascontiguousarray(v, np.float32).view(np.int32)
    biased = (bits >> 23) & 0xFF
    mant = (bits & 0x7FFFFF) | np.where(biased > 0, 1 << 23, 0)  # v = ±mant·2^(e), e = max(biased, 1) − 150
    e = np.maximum(biased, 1) - 150
    nz = mant != 0
    e_min = np.where(nz, e, 1 << 10).min(axis=1, keepdims=True)
    shift = np.where(nz, e - e_min, 0)
    if (shift > 38).any():  # the shifted values (24 + 38 bits) must fit int64
        return None
    big = mant.astype(np.int64) << shift
    gcd = np.maximum(np.gcd.reduce(big, axis=1, keepdims=True), 1)
    negative = (bits < 0) & nz
    mult = big // gcd
    if signed:  # multipliers of either sign; the base negative where only so do they fit (−128 … 127)
        mult = np.where(negative, -mult, mult)
        flip = (mult > 127).any(axis=1, keepdims=True)
        mult = np.where(flip, -mult, mult)
        if (mult < -128).any() or (mult > 127).any():
            return None
    else:  # one sign a row: the base carries it
        if (negative.any(axis=1) & (nz & ~negative).any(axis=1)).any() or (mult > 255).any():
            return None
        flip = negative.any(axis=1, keepdims=True)
    j = _half_divisor(gcd, np.abs(mult).max(axis=1, keepdims=True), 127 if signed else 255)
    gcd, mult = gcd // j, mult * j
    base = np.ldexp(np.where(flip, -gcd, gcd).astype(np.float64), np.where(nz.any(axis=1, keepdims=True), e_min, 0))
    if not np.array_equal(base.astype(np.float32).astype(np.float64), base):
        return None
    return mult.astype(np.int8 if signed else np.uint8), base.astype(np.float32)


def _half_divisor(gcd: np.ndarray, most: np.ndarray, limit: int) -> np.ndarray:
    """Per row, the least odd j dividing ``gcd`` with an odd part of gcd / j below 2^11 (float16's significand)
    and ``most``·j ≤ ``limit`` (the multipliers, times j, stay bytes); 1 where there is none. A K-quant import's
    gcd is d·gcd(a) and j the odd part of gcd(a): the base is llama.cpp's float16 d again, up to a power of two."""
    odd = gcd // (gcd & -gcd)
    j = np.ones_like(gcd)
    room = limit // np.maximum(most, 1)
    todo = (odd >= 1 << 11) & (room >= 3)
    for c in range(3, int(room[todo].max()) + 1 if todo.any() else 0, 2):
        hit = todo & (odd % c == 0) & (odd // c < 1 << 11) & (c <= room)
        j[hit], todo = c, todo & ~hit
        if not todo.any():
            break
    return j
