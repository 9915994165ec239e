r"""The LUT matmul in plain numpy: the oracle every compiled kernel is tested against.

Derivation. A ``b``-bit code is ``q = Σ_i 2^i·β_i`` with bits ``β_i ∈ {0, 1}``. Writing ``σ_i = 2β_i − 1 ∈ {−1, +1}``,

    q − 2^(b−1) = Σ_i 2^(i−1)·σ_i − ½.

So over one scale group (``w = s·(q − 2^(b−1)) − z``)

    Σ_k w_k x_k = s·( Σ_i 2^i · Σ_k ½σ_ik x_k  −  ½ Σ_k x_k )  −  z·Σ_k x_k.

Split ``k`` into runs of 4 activations (index ``t``). For each run there are only 16 sign patterns, so a
16-entry table ``T_t[p] = Σ_j (bit_j(p) − ½)·x_{4t+j}`` holds every possible ``Σ_j ½σ_j x_{4t+j}``; the
4 bits of bit-plane ``i`` of the weights of a run form the index ``p``. A matmul becomes table lookups:

    Σ_k ½σ_ik x_k = Σ_t T_t[nibble_it].

Tables are quantized to int8 with one scale per ``lut_group`` activations (``ls = max|T| / 127``), so the
kernel's inner loop is integer: ``R = Σ_i 2^i Σ_t qT_t[nibble_it]`` per (row, lut group). The float
epilogue recombines:

    y = Σ_g s_g·ls_g·R_g  −  Σ_G (½·s_G + z_G)·Σ_{k∈G} x_k.

Ternary weights per row (or tensor) have a denser layout, *triples*: three weights ``τ ∈ {−1, 0, 1}`` are one
of 27 patterns ``e = 9(τ0+1) + 3(τ1+1) + (τ2+1)``; a pattern and its negation ``26 − e`` share a table entry,
so ``(idx, neg) = (e, 0)`` for ``e ≤ 13`` and ``(26 − e, 1)`` otherwise: a 4-bit index plus a sign bit, 1.67
bits per weight instead of 2. The table of activations ``x_{3t..3t+2}`` holds ``T_t[p] = Σ_i c_i(p)·x_{3t+i}``
with ``c_i(p)`` the base-3 digits of ``p`` minus 1 (``p ≤ 13``; entries 14, 15 are 0), and

    Σ_k τ_k x_k = Σ_t (−1)^neg_t · T_t[idx_t],   y = Σ_g s·ls_g·R_g   (no Σx term: ternary codes are symmetric).

K is padded with zero activations to whole lut groups (``TRIPLE_LUT_GROUP``, a multiple of 24: the kernel's
step is 8 triples, whose sign bits share a byte).

Codebook formats (``WeightFormat.codebook``: llama.cpp's i-quants) give each 4-bit code an integer level
``c_q`` that no sum of bit planes spells; one activation to a table, its 16 entries the products with the levels,
``T_k[p] = c_p·x_k``, so each code is one lookup, as many as a 4-bit weight's four planes take:

    Σ_k w_k x_k = s·Σ_k T_k[q_k],   y = Σ_g s·ls_g·R_g   (no Σx term).

Every float operation of the table build is spelled out in the order the kernels perform it, so the int8
tables and the integer accumulators ``R`` are bit-exact between this module and the compiled kernels.
"""

from __future__ import annotations

import numpy as np

from tmac.base.formats import K_MULTIPLE, kernels_take
from tmac.base.qweight import QuantizedWeight

# sign of activation j in pattern p: +1 where bit j of p is set, −1 elsewhere; shape [16, 4]
SIGNS = np.array([[1.0 if p >> j & 1 else -1.0 for j in range(4)] for p in range(16)], dtype=np.float32)
# ternary triples: coefficient of activation i in entry p (base-3 digit i of p, minus 1; 0 past entry 13)
TRIPLE_COEFFS = np.array([[(p // 3 ** (2 - i)) % 3 - 1 if p <= 13 else 0 for i in range(3)] for p in range(16)],
                         dtype=np.float32)
LUT_GROUPS = (16, 32, 64, 128, 256)  # activations per table scale a kernel may have (16: groups of 16, as Q6_K's)
TRIPLE_LUT_GROUP = 192  # activations per table scale; int16 accumulators hold 8·127 per 24 activations safely


def padded_k(k: int) -> int:
    """K of the triple layout: rounded up to whole lut groups (zero activations, zero weights)."""
    return -(-k // TRIPLE_LUT_GROUP) * TRIPLE_LUT_GROUP


def default_lut_group(k: int, group_size) -> int:
    """Activations per table scale: the weight group size up to 128 (finer for per-row/per-tensor weights)."""
    if kernels_take(k):
        for lg in (128, 64, 32, 16):
            if k % lg == 0 and (not isinstance(group_size, int) or group_size % lg == 0):
                return lg
    raise ValueError(f"in_features K={k} must be a multiple of {K_MULTIPLE} for the LUT kernels")


def bit_planes(codes: np.ndarray, bits: int) -> np.ndarray:
    """``[bits, M, K]`` uint8 of 0/1: plane i holds bit i of every code."""
    return np.stack([(codes >> i) & 1 for i in range(bits)]).astype(np.uint8)


def plane_nibbles(codes: np.ndarray, bits: int) -> np.ndarray:
    """``[bits, M, K/4]`` table indices: bit j of entry t of plane i is bit i of ``codes[:, 4t+j]``."""
    m, k = codes.shape
    # one little-endian uint32 per run of 4 codes: byte j is code 4t+j. Bit i of each byte, masked into bits
    # 0/8/16/24 and multiplied by 2^24 + 2^17 + 2^10 + 2^3, lands byte j's bit at bit 24+j with no two partial
    # products on the same bit (no carries); >> 24 is then the nibble
    runs = np.ascontiguousarray(codes).view("<u4")
    out = np.empty((bits, m, k // 4), dtype=np.uint8)
    for i in range(bits):
        out[i] = (((runs >> np.uint32(i)) & np.uint32(0x01010101)) * np.uint32(0x01020408)) >> np.uint32(24)
    return out


def build_tables(x: np.ndarray) -> np.ndarray:
    """Float32 tables ``[N, K/4, 16]``: ``T[p] = 0.5·((c0·x0 + c1·x1) + (c2·x2 + c3·x3))``, in this fp32 order."""
    x = np.asarray(x, dtype=np.float32)
    xr = x.reshape(x.shape[0], -1, 1, 4)
    c = SIGNS.reshape(1, 1, 16, 4)
    t = xr * c  # exact: the signs are ±1
    return np.float32(0.5) * ((t[..., 0] + t[..., 1]) + (t[..., 2] + t[..., 3]))


def build_triple_tables(x: np.ndarray, k_padded: int) -> np.ndarray:
    """Float32 tables ``[N, Kp/3, 16]`` of the triple layout: ``T[p] = (c0·x0 + c1·x1) + c2·x2``, in this order."""
    x = np.asarray(x, dtype=np.float32)
    xp = np.zeros((x.shape[0], k_padded), np.float32)
    xp[:, :x.shape[1]] = x
    t = xp.reshape(x.shape[0], -1, 1, 3) * TRIPLE_COEFFS.reshape(1, 1, 16, 3)  # exact: coefficients are 0, ±1
    return (t[..., 0] + t[..., 1]) + t[..., 2]


def build_codebook_tables(x: np.ndarray, codebook) -> np.ndarray:
    """Float32 tables ``[N, K, 16]`` of a codebook format: ``T_k[p] = c_p·x_k`` (one rounding)."""
    x = np.asarray(x, dtype=np.float32)
    return x[:, :, None] * np.asarray(codebook, np.float32)[None, None, :]


TRIPLE_ROWS = 64  # rows at a time: the temporaries stay in L2


def triple_indices(codes: np.ndarray, k_padded: int) -> tuple[np.ndarray, np.ndarray]:
    """Ternary codes (1..3) ``[M, K]`` → table indices ``[M, Kp/3]`` (0..13) and negation flags (bool): with
    τ = code − 1 (1 in the padding) and e = 9·τ0 + 3·τ1 + τ2 of each triple, the index is e, or 26 − e flagged
    where e > 13. Computed on whole rows (9·c[j] + 3·c[j+1] + c[j+2] at every j, then every third: operations
    on strided triples are several times slower)."""
    m, k = codes.shape
    c = np.ascontiguousarray(codes)
    if k_padded != k:
        c = np.full((m, k_padded), 2, np.uint8)
        c[:, :k] = codes
    t = k_padded // 3
    idx, neg, flat = np.empty((m, t), np.uint8), np.empty((m, t), bool), c.reshape(-1)
    for r0 in range(0, m, TRIPLE_ROWS):
        x = flat[r0 * k_padded:(r0 + TRIPLE_ROWS) * k_padded]
        e = x[:-2] * np.uint8(9)
        e += x[1:-1] * np.uint8(3)
        e += x[2:]
        e = np.ascontiguousarray(e[0::3]).reshape(-1, t)  # triples start at multiples of 3 (K' is one)
        if x.size and (x.max() > 3 or x.min() < 1):  # (a TQ2_0 block's unused 2-bit value 3 is code 4)
            raise ValueError(f"ternary codes must lie in [1, 3], got [{x.min()}, {x.max()}] in rows from {r0}")
        # e + 13 here: the index min(e, 26 − e), negated where e > 13
        np.minimum(e - np.uint8(13), np.uint8(39) - e, out=idx[r0:r0 + TRIPLE_ROWS])
        np.greater(e, 26, out=neg[r0:r0 + TRIPLE_ROWS])
    return idx, neg


def quantize_tables(tables: np.ndarray, lut_group: int, per_table: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """int8 tables and their float32 scales ``[N, K/lut_group]``: ``qT = rint(T·(127/amax))``, ``ls = amax/127``
    (``per_table``: activations per table, 4, or 3 for triples)."""
    n, kt, _ = tables.shape
    per = lut_group // per_table
    tg = tables.reshape(n, kt // per, per * 16)
    amax = np.abs(tg).max(axis=2)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.rint(tg * inv[..., None]).astype(np.int8).reshape(n, kt, 16)
    return q, (amax / np.float32(127)).astype(np.float32)


def lut_accumulate(qtables: np.ndarray, codes: np.ndarray, bits: int, lut_group: int) -> np.ndarray:
    """The kernels' integer part: ``R[n, m, g] = Σ_i 2^i Σ_{t∈g} qT[n, t, nibble_i[m, t]]`` (int32)."""
    nib = plane_nibbles(codes, bits)  # [b, M, K/4]
    n, kt, _ = qtables.shape
    m = codes.shape[0]
    per = lut_group // 4
    r = np.zeros((n, m, kt // per), dtype=np.int64)
    t_idx = np.arange(kt)
    for row in range(n):
        for i in range(bits):
            looked = qtables[row, t_idx[None, :], nib[i]].astype(np.int64)  # [M, K/4]
            r[row] += looked.reshape(m, -1, per).sum(axis=2) << i
    return r.astype(np.int32)


def lut_accumulate_codebook(qtables: np.ndarray, codes: np.ndarray, lut_group: int) -> np.ndarray:
    """The codebook kernels' integer part: ``R[n, m, g] = Σ_{k∈g} qT[n, k, codes[m, k]]`` (int32)."""
    n, k, _ = qtables.shape
    m = codes.shape[0]
    r = np.zeros((n, m, k // lut_group), dtype=np.int64)
    for row in range(n):
        looked = qtables[row, np.arange(k)[None, :], codes].astype(np.int64)  # [M, K]
        r[row] = looked.reshape(m, -1, lut_group).sum(axis=2)
    return r.astype(np.int32)


def lut_accumulate_triples(qtables: np.ndarray, idx: np.ndarray, neg: np.ndarray, lut_group: int) -> np.ndarray:
    """The triple kernels' integer part: ``R[n, m, g] = Σ_{t∈g} ±qT[n, t, idx[m, t]]`` (int32)."""
    n, kt, _ = qtables.shape
    m, per = idx.shape[0], lut_group // 3
    sign = np.where(neg, -1, 1)
    r = np.zeros((n, m, kt // per), dtype=np.int64)
    for row in range(n):
        looked = qtables[row, np.arange(kt)[None, :], idx].astype(np.int64) * sign
        r[row] = looked.reshape(m, -1, per).sum(axis=2)
    return r.astype(np.int32)


def lut_epilogue(r: np.ndarray, lut_scales: np.ndarray, x: np.ndarray, qw: QuantizedWeight,
                 lut_group: int) -> np.ndarray:
    """Float64 ``[N, M]`` from the integer accumulators: ``Σ_g s·ls·R − Σ_G (½s + z)·Σx`` (codebooks: no Σx
    term)."""
    m, k = qw.shape
    s_per_k = qw.expanded(qw.scales)  # [M, K]
    s_lg = s_per_k[:, ::lut_group]  # scale of each lut group (lut groups never straddle weight groups)
    y = np.einsum("nmg,ng,mg->nm", r.astype(np.float64), lut_scales.astype(np.float64), s_lg)
    if qw.format.codebook is not None:
        return y
    bias = 0.5 * s_per_k + (qw.expanded(qw.zeros) if qw.zeros is not None else 0.0)
    return y - np.asarray(x, np.float64) @ bias.T


def lut_matmul(x: np.ndarray, qw: QuantizedWeight, lut_group: int | None = None) -> np.ndarray:
    """``x @ W.T`` the LUT way, float64 ``[N, M]``; ``x`` is float ``[N, K]``."""
    x = np.asarray(x, dtype=np.float32)
    lg = lut_group or default_lut_group(qw.shape[1], qw.format.group_size)
    if qw.format.codebook is not None:
        qt, ls = quantize_tables(build_codebook_tables(x, qw.format.codebook), lg, per_table=1)
        return lut_epilogue(lut_accumulate_codebook(qt, np.asarray(qw.codes), lg), ls, x, qw, lg)
    qt, ls = quantize_tables(build_tables(x), lg)
    return lut_epilogue(lut_accumulate(qt, qw.codes, qw.format.bits, lg), ls, x, qw, lg)


def lut_matmul_triples(x: np.ndarray, qw: QuantizedWeight) -> np.ndarray:
    """``x @ W.T`` for ternary ``qw`` with one scale per row or tensor, the triple way; float64 ``[N, M]``."""
    if not qw.format.ternary or qw.scales.shape[1] != 1:
        raise ValueError(f"the triple layout needs ternary weights with per-row/per-tensor scales, got {qw.format.name}")
    x = np.asarray(x, dtype=np.float32)
    kp = padded_k(qw.shape[1])
    qt, ls = quantize_tables(build_triple_tables(x, kp), TRIPLE_LUT_GROUP, per_table=3)
    r = lut_accumulate_triples(qt, *triple_indices(qw.codes, kp), TRIPLE_LUT_GROUP)
    s = np.broadcast_to(qw.scales.astype(np.float64), (qw.shape[0], 1))[:, 0]
    return np.einsum("nmg,ng->nm", r.astype(np.float64), ls.astype(np.float64)) * s


# ---- the dot-product path (many activation rows) -------------------------------------------------------------------
QUANT_BLOCK = 32  # activations per int8 scale of the dot-product kernels' activations


def quantize_activations(x: np.ndarray, block: int = QUANT_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """int8 activations and their float32 scales ``[N, K/block]``: per block of ``block`` (32, or a K-quant's super
    group of 256, as llama.cpp's Q8_K), ``qx = rint(x·(127/amax))``, ``d = amax/127`` (the tables' rounding,
    ``quantize_tables``, applied to the activations themselves)."""
    x = np.asarray(x, np.float32)
    n, k = x.shape
    blocks = x.reshape(n, k // block, block)
    amax = np.abs(blocks).max(axis=2)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.rint(blocks * inv[..., None]).astype(np.int8).reshape(n, k)
    return q, (amax / np.float32(127)).astype(np.float32)


def quantized_sums(q: np.ndarray, d: np.ndarray, group_size: int, block: int = QUANT_BLOCK) -> np.ndarray:
    """float32 ``[N, K/unit]``: ``d·Σq`` of the rounded activations of each unit, ``min(group_size, 32)`` of them
    (a block, or half a block for groups of 16; ``d`` the scale of the ``block`` it lies in). The dot-product
    kernels' Σx term takes these, not the float activations' sums: then the offset and zero terms round with the
    codes' products, and the error is the weights' times the activations' rounding, as in llama.cpp (the float
    sums, against codes 0..15, doubled it)."""
    n, k = q.shape
    unit = min(group_size, QUANT_BLOCK)
    sums = q.reshape(n, k // unit, unit).astype(np.int32).sum(axis=2).astype(np.float32)
    return sums * np.repeat(d, block // unit, axis=1)


def dot_matmul(x: np.ndarray, qw: QuantizedWeight, block: int = QUANT_BLOCK) -> np.ndarray:
    """``x @ W.T`` the dot-product way, float64 ``[N, M]``: the exact product of the rounded activations
    (``quantize_activations`` in blocks of ``block``, the kernel spec's ``activation_block``: ``d·qx``) with the
    weights, whose codes times ``d·qx`` the kernels sum in integers and whose offset and zero multiply
    ``quantized_sums``."""
    qx, d = quantize_activations(x, block)
    xq = qx.astype(np.float64) * np.repeat(d.astype(np.float64), block, axis=1)
    return xq @ qw.dequantize().astype(np.float64).T
