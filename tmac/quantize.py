"""Float → ``QuantizedWeight`` quantizers, and exact importers of GGUF blocks.

Quantizers (round half to even, as torch and numpy round):
- asymmetric: a group's lowest level lo and step s, q = round((w − lo)/s), z = −(s·2^(b−1) + lo). By default
  (``search``) lo and s come from a search, as llama.cpp's k-quant quantizers run one: the min/max range and
  ranges shrunk about its middle, each refitted by weighted least squares to the codes it rounds to and its codes
  rounded again; the candidate of least weighted squared error wins, a weight counting the group's rms plus its
  own magnitude (llama.cpp's importance: plain squared error clipped the large weights a model needs, and
  SmolLM2 at 3 bits in groups of 64 read text worse than with min/max; docs/decisions.md, "The quantizer's
  search"). It costs 2-3x min/max's time. ``search=False``: plain
  min/max, s = (max − min)/(2^b − 1). At 1 bit the two levels are the means of the values below and above the
  group mean (the optimal two-level split);
- symmetric absmax, llama.cpp style: the signed value of largest magnitude maps to code 0, s = that / −2^(b−1);
- ternary absmean (BitNet b1.58): s = mean|w| (at least 1e-5), t = clip(round(w/s), −1, 1), q = t + 2.

The round-to-nearest formats store float16 parameters: s and z are rounded to float16 first and the codes are
chosen against the rounded grid. Weights whose parameters float16 cannot hold to 3 significant digits (outside
its normal range) get the float32 variant of the format instead.
"""

from __future__ import annotations

import numpy as np

from .errors import InexactImport
from .formats import FORMATS, GGUF_EXACT, PER_TENSOR, WeightFormat, check_bits
from .qweight import QuantizedWeight, all_float16


def quantize_weight(w, bits: int = 2, group_size: int | str = 128, symmetric: bool = False,
                    ternary: bool = False, search: bool = True) -> QuantizedWeight:
    """Quantize a float matrix ``[out_features, in_features]`` (numpy, torch, or a row source: see
    ``_as_float_matrix``) group-wise.

    ``group_size`` is 32/64/128/256, ``"row"`` or ``"tensor"``. ``ternary=True`` gives BitNet b1.58 absmean
    ternary weights (``bits`` and ``symmetric`` are then ignored; BitNet itself uses ``group_size="tensor"``).
    ``search``: asymmetric levels of least weighted squared error (the module doc); False: each group's min and max.
    """
    if not isinstance(search, (bool, np.bool_)):
        raise TypeError(f"search must be True or False, got {search!r}")
    w = _as_float_matrix(w)
    if ternary:
        fmt = WeightFormat.ternary_format(group_size)
    else:
        check_bits(bits)
        if symmetric and bits == 1:
            raise ValueError("bits=1 with symmetric=True has only the levels {-s, 0}; use symmetric=False "
                             "(levels min and max of each group)")
        fmt = WeightFormat.rtn(bits, group_size, symmetric)
    m, k = w.shape
    rows = max(1, QUANTIZE_CHUNK // k)
    if fmt.group_size != PER_TENSOR and m > rows:  # groups lie within rows: slices quantize as the whole would
        first = _quantize(_rows64(w, 0, rows), fmt, symmetric, search)
        codes, scales = np.empty((m, k), np.uint8), np.empty((m, first.scales.shape[1]), first.scales.dtype)
        zeros = None if first.zeros is None else np.empty(scales.shape, first.zeros.dtype)
        for i in range(0, m, rows):
            p = first if i == 0 else _quantize(_rows64(w, i, i + rows), fmt, symmetric, search)
            if p.format != first.format:  # some scales beyond float16: the whole matrix decides
                break
            codes[i:i + rows], scales[i:i + rows] = p.codes, p.scales
            if zeros is not None:
                zeros[i:i + rows] = p.zeros
        else:
            return QuantizedWeight(codes, scales, zeros, first.format)
    return _quantize(_rows64(w, 0, m), fmt, symmetric, search)


QUANTIZE_CHUNK = 1 << 22  # weights quantized at a time: float64 temporaries of 32 MiB each, not of a whole head


def _quantize(w: np.ndarray, fmt: WeightFormat, symmetric: bool, search: bool) -> QuantizedWeight:
    """``w``: float64 rows."""
    m, k = w.shape
    bits, group_size = fmt.bits, fmt.group_size
    groups = _grouped(w, fmt)  # [M', G, gs]
    top = (1 << fmt.bits) - 1
    if fmt.ternary:
        s = np.maximum(np.abs(groups).mean(axis=2), 1e-5)
        t = np.clip(np.rint(groups / s[..., None]), -1, 1)
        codes, zeros = t + 2, None
    elif symmetric:
        idx = np.abs(groups).argmax(axis=2)[..., None]
        s = np.take_along_axis(groups, idx, axis=2)[..., 0] / -fmt.offset
        s16 = _as_half(s, relative=True)
        s = s.astype(np.float32) if s16 is None else s16
        inv = np.divide(1.0, s.astype(np.float64), out=np.zeros(s.shape), where=s != 0)
        codes = np.clip(np.rint(groups * inv[..., None]) + fmt.offset, 0, top)
        zeros = None
    else:
        lo, hi = _level_range(groups, bits)
        lo, s = _least_squares_levels(groups, lo, hi, top) if search and bits > 1 else (lo, (hi - lo) / top)
        s = np.where(s > 0, s, 1.0)
        s16 = _as_half(s, relative=True)
        # z = −(s·offset + lo) puts the lowest level at lo; a float16 z is off by at most 2^-11 of it
        zeros = None if s16 is None else _as_half(-(s16 * fmt.offset + lo), relative=False)
        if zeros is None:
            s = s.astype(np.float32)
            zeros = (-(s.astype(np.float64) * fmt.offset + lo)).astype(np.float32)
        else:
            s = s16
        # the codes nearest to w on the stored grid s·(q − offset) − z
        s64 = s.astype(np.float64)
        level0 = -(s64 * fmt.offset + zeros)
        codes = _nearest_codes(groups, level0, s64, top)
    if s.dtype == np.float32 and not fmt.ternary:
        fmt = WeightFormat.rtn(bits, group_size, symmetric, half=False)
    shape = fmt.scale_shape(m, k)
    return QuantizedWeight(codes.reshape(m, k).astype(np.uint8), s.reshape(shape).astype(np.float32),
                           None if zeros is None else zeros.reshape(shape).astype(np.float32), fmt)


def _as_half(p: np.ndarray, relative: bool) -> np.ndarray | None:
    """``p`` rounded to float16, or None where float16 cannot hold it: beyond its range, or — for ``relative``
    parameters (scales, whose error scales every weight) — nonzero values below its normal range."""
    mag = np.abs(p)
    ok = mag <= np.finfo(np.float16).max
    if relative:
        ok &= (mag == 0) | (mag >= np.finfo(np.float16).tiny)
    return p.astype(np.float16).astype(np.float64) if ok.all() else None


def _level_range(groups: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Lowest and highest quantization level per group: min/max, except at 1 bit, where min/max levels lose
    more than they keep (relative error > 1 on Gaussian weights) and the two conditional means around the
    group mean — the optimal two-level split — are used instead."""
    if bits > 1:
        return groups.min(axis=2), groups.max(axis=2)
    above = groups >= groups.mean(axis=2, keepdims=True)
    n_above = above.sum(axis=2)
    hi = np.where(above, groups, 0).sum(axis=2) / np.maximum(n_above, 1)
    lo = np.where(above, 0, groups).sum(axis=2) / np.maximum(groups.shape[2] - n_above, 1)
    return np.where(n_above < groups.shape[2], lo, hi), hi


SHRINK = (1.0, 0.85, 0.7)  # min/max ranges tried, as fractions about their middle (1.0-0.6 in steps of 0.1: no better)
SEARCH_BLOCK = 1 << 17  # weights searched at a time: passes in L2 (16384x2048 W2: 1.45 s a chunk at once, 0.86)
SEARCH_LIMIT = 1e15  # groups with larger weights keep min/max: float32 squares of them could overflow


def _least_squares_levels(groups: np.ndarray, lo: np.ndarray, hi: np.ndarray, top: int):
    """(lowest level, step) per group of least weighted squared error among the ``SHRINK`` candidates (module
    doc), searched ``SEARCH_BLOCK`` weights at a time."""
    rows, lo, hi = groups.reshape(-1, groups.shape[2]), lo.reshape(-1), hi.reshape(-1)
    first, s = np.empty(len(rows)), np.empty(len(rows))
    step = max(1, SEARCH_BLOCK // rows.shape[1])
    for i in range(0, len(rows), step):
        part = slice(i, i + step)
        if max(np.abs(lo[part]).max(), np.abs(hi[part]).max()) < SEARCH_LIMIT:
            first[part], s[part] = _search_block(rows[part].astype(np.float32), lo[part], hi[part], top)
        else:
            first[part], s[part] = lo[part], (hi[part] - lo[part]) / top
    return first.reshape(groups.shape[:2]), s.reshape(groups.shape[:2])


def _search_block(groups: np.ndarray, lo: np.ndarray, hi: np.ndarray, top: int):
    """``_least_squares_levels`` of float32 groups: the passes over weights in float32 (a third faster than
    float64), the fits per group in float64."""
    importance = np.sqrt(np.mean(np.square(groups), axis=1, keepdims=True)) + np.abs(groups)  # (module doc)
    i_sum = importance.sum(axis=1, dtype=np.float64)
    ig_sum = (importance * groups).sum(axis=1, dtype=np.float64)
    best = None
    for f in SHRINK:
        span = (hi - lo) * f
        s = np.where(span > 0, span / top, 1.0)  # (a constant group: any step, every code 0)
        first = lo + 0.5 * (hi - lo - span)
        q = _nearest_codes(groups, first.astype(np.float32), s.astype(np.float32), top)
        # the weighted least-squares line w ≈ first + s·q through the codes, where they are not all one code
        iq = importance * q
        q_sum = iq.sum(axis=1, dtype=np.float64)
        qq, qg = (np.einsum("ij,ij->i", iq, b).astype(np.float64) for b in (q, groups))
        det = i_sum * qq - q_sum * q_sum
        fit_s = (i_sum * qg - q_sum * ig_sum) / np.where(det > 0, det, 1.0)
        ok = (det > 1e-9 * i_sum * qq) & (fit_s > 0)
        s = np.where(ok, fit_s, s)
        first = np.where(ok, (ig_sum - fit_s * q_sum) / np.where(i_sum > 0, i_sum, 1.0), first)  # (all-zero groups)
        first32, s32 = first.astype(np.float32), s.astype(np.float32)
        q = _nearest_codes(groups, first32, s32, top)
        miss = np.square(first32[:, None] + s32[:, None] * q - groups)
        err = np.einsum("ij,ij->i", importance, miss).astype(np.float64)
        if best is None:
            best = [err, first, s]
        else:
            better = err < best[0]
            best = [np.where(better, new, old) for new, old in zip((err, first, s), best)]
    return best[1], best[2]


def _nearest_codes(groups, first, s, top):
    return np.clip(np.rint((groups - first[..., None]) / s[..., None]), 0, top)


def _as_float_matrix(w):
    """``w`` checked to be a non-empty 2-D float matrix: a numpy array, a torch tensor kept in its own dtype (a
    bfloat16 head is converted a slice at a time by ``_rows64``, never as a whole float32 copy), or a row source
    (``shape`` and ``rows(start, stop)`` giving float rows: a GGUF tensor dequantized a slice at a time)."""
    if hasattr(w, "rows") and hasattr(w, "shape"):
        if len(w.shape) != 2 or 0 in w.shape:
            raise ValueError(f"weight must be a non-empty 2-D matrix, got shape {tuple(w.shape)}")
        return w
    if hasattr(w, "detach"):  # torch tensor, without importing torch here
        if not w.dtype.is_floating_point:
            raise TypeError(f"weight must be a floating-point tensor, got dtype {w.dtype}")
        w = w.detach().cpu()
    elif not isinstance(w, np.ndarray):
        raise TypeError(f"weight must be a numpy array or torch tensor, got {type(w).__name__}")
    elif w.dtype.kind != "f":
        raise TypeError(f"weight must be a floating-point array, got dtype {w.dtype}")
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(w.shape)}")
    if 0 in w.shape:
        raise ValueError(f"weight must not be empty, got shape {tuple(w.shape)}")
    return w


def _rows64(w, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of a checked matrix as float64, themselves checked to be finite."""
    part = np.asarray(w.rows(start, stop), dtype=np.float64) if hasattr(w, "rows") else \
        w[start:stop].double().numpy() if hasattr(w, "detach") else w[start:stop].astype(np.float64)
    if not np.isfinite(part).all():
        raise ValueError("weight contains NaN or inf")
    return part


def _grouped(w: np.ndarray, fmt: WeightFormat) -> np.ndarray:
    m, k = w.shape
    if fmt.group_size == PER_TENSOR:
        return w.reshape(1, 1, m * k)
    return w.reshape(m, fmt.groups_per_row(k), -1)


# ---- exact GGUF importers ------------------------------------------------------------------------------

def import_gguf(data, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """Import a GGUF tensor of an exactly importable type (``tmac.formats.GGUF_EXACT``) without requantizing.

    ``data`` holds the raw blocks (bytes or a uint8 array, as ``gguf.GGUFReader`` gives them); ``shape`` is
    ``(rows, row_length)`` — numpy order, i.e. GGUF's ``ne`` reversed. ``.dequantize()`` of the result equals
    ``gguf.quants.dequantize`` bit for bit; ``InexactImport`` where it could not (a block's zero that is not a
    float32 value).
    """
    fmt = GGUF_EXACT.get(type_name)
    if fmt is None:
        raise ValueError(f"no exact importer for GGUF type {type_name}; exact types: {sorted(GGUF_EXACT)}")
    m, k = shape
    blk = fmt.gguf
    if k % blk.block_size:
        raise ValueError(f"GGUF {type_name} row length {k} is not a multiple of its block size {blk.block_size}")
    raw = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) \
        else np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    nblocks = m * k // blk.block_size
    if raw.size != nblocks * blk.type_size:
        raise ValueError(f"GGUF {type_name} tensor of shape {shape} needs {nblocks * blk.type_size} bytes, "
                         f"got {raw.size}")
    blocks = raw.reshape(m, k // blk.block_size, blk.type_size)
    # row slices: the decoders' temporaries (several times the codes) stay small beside a 49152-row head
    rows = max(1, QUANTIZE_CHUNK // k)
    codes, scales, zeros = np.empty((m, k), np.uint8), np.empty((m, k // fmt.group_size), np.float32), None
    for r0 in range(0, m, rows):
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf scales are refused by name below
            c, d, z = _DECODERS[type_name](blocks[r0:r0 + rows].reshape(-1, blk.type_size), fmt.offset)
        codes[r0:r0 + rows], scales[r0:r0 + rows] = c.reshape(-1, k), d.reshape(-1, scales.shape[1])
        if z is not None:
            z = z.reshape(-1, scales.shape[1])  # float64, from the decoders
            zeros = np.empty(scales.shape, np.float32) if zeros is None else zeros
            zeros[r0:r0 + rows] = z
            inexact = (zeros[r0:r0 + rows] != z) & np.isfinite(z)
            if inexact.any():
                raise InexactImport(f"GGUF {type_name} tensor: the zero of a block in row {r0 + inexact.any(1).argmax()} "
                                    f"is not a float32 value ({z[inexact][0]!r})")
    bad = ~np.isfinite(scales) | (~np.isfinite(zeros) if zeros is not None else False)
    if bad.any():
        raise ValueError(f"GGUF {type_name} tensor has {int(bad.sum())} blocks with NaN/inf scale or min")
    if zeros is not None and fmt.takes_half_zeros and all_float16(zeros):
        fmt = fmt.with_half_zeros()
    if fmt.ternary:
        row_scales = _uniform_row_scales(codes, scales, blk.block_size)
        if row_scales is not None:  # BitNet conversions: one scale per tensor, repeated in every block
            return QuantizedWeight(codes, row_scales, None, fmt.per_row())
    return QuantizedWeight(codes, scales, zeros, fmt)


def _uniform_row_scales(codes: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray | None:
    """One scale per row when, in every row, all blocks holding a nonzero ternary weight share their scale
    (all-zero blocks dequantize to 0 whatever theirs is); else None."""
    first = np.empty((len(scales), 1), scales.dtype)
    rows = max(1, QUANTIZE_CHUNK // codes.shape[1])
    for r0 in range(0, len(scales), rows):  # in row slices, as the import: a boolean per weight is a temporary
        s = scales[r0:r0 + rows]
        nonzero = (codes[r0:r0 + rows] != 2).reshape(len(s), -1, block).any(axis=2)
        f = np.where(nonzero.any(axis=1), s[np.arange(len(s)), nonzero.argmax(axis=1)], s[:, 0])
        if not ((s == f[:, None]) | ~nonzero).all():
            return None
        first[r0:r0 + rows, 0] = f
    return first


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16)[:, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """A block's 16 bytes hold weights j (low nibble) and j + 16 (high nibble)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Bit j of a block's 4 little-endian bytes ``qh`` is the fifth bit of its weight j (Q5_0, Q5_1), as 16."""
    return (np.unpackbits(qh, axis=1, bitorder="little") << 4).astype(np.uint8)


# Decoders: (raw blocks [n, type_size], the format's offset) → (codes [n, block], scales [n, groups], zeros or None)
# with w = s·(code − offset) − z

def _decode_q4_0(blocks, offset):
    return _nibbles(blocks[:, 2:]), _f16(blocks, 0).astype(np.float32), None


def _decode_q5_0(blocks, offset):
    return _nibbles(blocks[:, 6:]) | _fifth_bits(blocks[:, 2:6]), _f16(blocks, 0).astype(np.float32), None


def _decode_q8_0(blocks, offset):
    # w = d·q with q signed: code q + offset
    return (blocks[:, 2:].view(np.int8).astype(np.int16) + offset).astype(np.uint8), \
        _f16(blocks, 0).astype(np.float32), None


def _decode_q4_1(blocks, offset, codes=None):
    d = _f16(blocks, 0).astype(np.float64)
    m = _f16(blocks, 2).astype(np.float64)
    # w = d·q + m = d·(q − offset) − z with z = −(m + offset·d); exact in float64 (both are float16 values)
    return _nibbles(blocks[:, 4:]) if codes is None else codes, d.astype(np.float32), -(m + offset * d)


def _decode_q5_1(blocks, offset):
    return _decode_q4_1(blocks, offset, _nibbles(blocks[:, 8:]) | _fifth_bits(blocks[:, 4:8]))


def _two_bit_fields(qs: np.ndarray) -> np.ndarray:
    """``[n, 4·B]`` 2-bit fields of bytes ``qs [n, B]`` in runs of 32 bytes: weight 128h + 32i + l is bits 2i of
    byte 32h + l (TQ2_0, Q2_K, Q3_K's low bits)."""
    fields = qs.reshape(len(qs), -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return (fields & 3).reshape(len(qs), -1)


def _decode_tq2_0(blocks, offset):
    return _two_bit_fields(blocks[:, :64]) + (offset - 1), _f16(blocks, 64).astype(np.float32), None  # w = d·(q − 1)


def _decode_q2_k(blocks, offset):
    sc = blocks[:, :16]
    s = _f16(blocks, 80).astype(np.float64)[:, None] * (sc & 0x0F)  # exact: 11 × 4 significant bits
    # w = s·q − dmin·b = s·(q − offset) − z with z = dmin·b − offset·s; exact in float64
    return _two_bit_fields(blocks[:, 16:80]), s.astype(np.float32), \
        _f16(blocks, 82).astype(np.float64)[:, None] * (sc >> 4) - offset * s


def _decode_q3_k(blocks, offset):
    low, high = blocks[:, 96:104], blocks[:, 104:108]
    a = np.concatenate([low & 0x0F, low >> 4], axis=1) | \
        (((high[:, None, :] >> np.array([0, 2, 4, 6], np.uint8)[None, :, None]) & 3) << 4).reshape(-1, 16)
    s = _f16(blocks, 108).astype(np.float32)[:, None] * (a.astype(np.float32) - 32)  # exact: 11 × 6 bits
    hbit = (blocks[:, None, :32] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [n, 8, 32]: weight 32i + l
    # w = s·(q − 4·(1 − hbit)) with q the 2-bit field: code q + 4·hbit, offset 4
    return _two_bit_fields(blocks[:, 32:96]) | (hbit.reshape(-1, 256) << 2), s, None


def _decode_q6_k(blocks, offset):
    ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)  # [n, h, nibble, 64]
    q = (ql & 0x0F).reshape(-1, 256) | (_two_bit_fields(blocks[:, 128:192]) << 4)
    s = _f16(blocks, 208).astype(np.float32)[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return q, s, None  # w = d·sc·(q − 32): exact scales (11 × 8 bits)


_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)


def _decode_tq1_0(blocks, offset):
    def trits(b, n):  # base-3 digits stored as fixed-point fractions of 256; uint8 products wrap on purpose
        t = (b.reshape(len(b), 1, -1) * _POW3[:n].reshape(1, n, 1)).reshape(len(b), -1)
        return ((t.astype(np.uint16) * 3) >> 8).astype(np.uint8)

    q = np.concatenate([trits(blocks[:, :32], 5), trits(blocks[:, 32:48], 5), trits(blocks[:, 48:52], 4)], axis=1)
    return q + (offset - 1), _f16(blocks, 52).astype(np.float32), None  # w = d·(q − 1)


def _decode_q4_k(blocks, offset, qh=None):
    a, b = _q4_k_scales(blocks[:, 4:16])
    s = _f16(blocks, 0).astype(np.float64)[:, None] * a  # exact: 11 × 6 significant bits
    qs = blocks[:, -128:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(-1, 8, 32)
    if qh is not None:  # Q5_K: bit j of byte l is the fifth bit of weight l of group j
        q = q | ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4
    # w = s·q − dmin·b = s·(q − offset) − z with z = dmin·b − offset·s; exact in float64
    return q.reshape(-1, 256), s.astype(np.float32), _f16(blocks, 2).astype(np.float64)[:, None] * b - offset * s


def _decode_q5_k(blocks, offset):
    return _decode_q4_k(blocks, offset, blocks[:, 16:48])


def _q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scale and min multipliers of a Q4_K block's 8 groups from its 12 bytes: bytes 0-3 hold scales
    0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same for the mins, bytes 8-11 the low nibbles
    of scales 4-7 (low) and mins 4-7 (high)."""
    lo, hi, mixed = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    a = np.concatenate([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], axis=1)
    b = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], axis=1)
    return a.astype(np.float64), b.astype(np.float64)


_DECODERS = {"Q8_0": _decode_q8_0, "Q4_0": _decode_q4_0, "Q4_1": _decode_q4_1, "Q5_0": _decode_q5_0,
             "Q5_1": _decode_q5_1, "TQ2_0": _decode_tq2_0, "TQ1_0": _decode_tq1_0, "Q4_K": _decode_q4_k,
             "Q5_K": _decode_q5_k, "Q2_K": _decode_q2_k, "Q3_K": _decode_q3_k, "Q6_K": _decode_q6_k}
assert set(_DECODERS) == set(GGUF_EXACT), "every exact GGUF format in formats.FORMATS needs a decoder"
assert all(FORMATS[f.name] is f for f in GGUF_EXACT.values())
