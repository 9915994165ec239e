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

from typing import Callable

import numpy as np

from tmac.base.errors import InexactImport
from tmac.base.formats import GGUF_EXACT, PER_TENSOR, WeightFormat, check_bits
from tmac.base.gguf_blocks import super_scaled
from tmac.base.qweight import QuantizedWeight, RowCodes, all_float16


def quantize_weight(w, bits: int = 4, group_size: int | str = 128, symmetric: bool = False,
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
STREAM_CODES = 1 << 22  # codes of an imported matrix from which they stay in the file until packed


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

def import_gguf(data, type_name: str, shape: tuple[int, int], decoded_pages: Callable[[], object] | None = None
                ) -> QuantizedWeight:
    """Import a GGUF tensor of an exactly importable type (``tmac.base.formats.GGUF_EXACT``) without requantizing.

    ``data`` holds the raw blocks (bytes or a uint8 array, as ``gguf.GGUFReader`` gives them); ``shape`` is
    ``(rows, row_length)`` — numpy order, i.e. GGUF's ``ne`` reversed. ``.dequantize()`` of the result equals
    ``gguf.quants.dequantize`` bit for bit; ``InexactImport`` where it could not (a block's zero that is not a
    float32 value). ``decoded_pages`` is called after each later decoding of a streamed matrix's rows (the
    loader releases the file's pages there).
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

    def decoded(r0: int, r1: int):
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf scales are refused by name below
            return blk.decoder()(blocks[r0:r1].reshape(-1, blk.type_size), fmt.offset)

    def decoded_codes(r0: int, r1: int) -> np.ndarray:
        with np.errstate(invalid="ignore", over="ignore"):
            codes = blk.code_decoder()(blocks[r0:r1].reshape(-1, blk.type_size), fmt.offset).reshape(-1, k)
        if decoded_pages is not None:
            decoded_pages()
        return codes

    # row slices: the decoders' temporaries (several times the codes) stay small beside a 49152-row head; a
    # matrix of STREAM_CODES codes and more keeps its codes in the file, decoded again a slice at a time as the
    # packing reads them
    rows = max(1, QUANTIZE_CHUNK // k)
    streamed = m * k >= STREAM_CODES
    codes = RowCodes((m, k), decoded_codes, blocks.reshape(m, -1), type_name) if streamed else \
        np.empty((m, k), np.uint8)
    scales, zeros = np.empty((m, k // fmt.group_size), np.float32), None
    nonzero = np.empty((m, k // blk.block_size), bool) if fmt.ternary else None
    super_params, factors = blk.super_params(), None
    if super_params is not None:  # llama.cpp's multipliers and d, dmin: the packing takes them as they are
        factors = tuple(None if f is None else (f[0].reshape(m, -1), f[1].astype(np.float32).reshape(m, -1))
                        for f in super_params(blocks.reshape(-1, blk.type_size)))
    for r0 in range(0, m, rows):
        if streamed and factors is not None:  # the parameters alone: the codes are decoded as they are packed
            c, (d, z) = None, super_scaled(_super_blocks(factors, r0, r0 + rows, fmt.groups_per_super), fmt.offset)
        elif streamed and not fmt.ternary and blk.scale_decoder() is not None:  # (ternary: see which blocks are 0)
            with np.errstate(invalid="ignore", over="ignore"):
                c, (d, z) = None, blk.scale_decoder()(blocks[r0:r0 + rows].reshape(-1, blk.type_size), fmt.offset)
        else:
            c, d, z = decoded(r0, r0 + rows)
            if fmt.ternary:  # which blocks hold a nonzero weight (code 2 is 0), while the codes are at hand
                nonzero[r0:r0 + rows] = (c.reshape(-1, blk.block_size) != 2).any(axis=1).reshape(-1, k // blk.block_size)
        scales[r0:r0 + rows] = d.reshape(-1, scales.shape[1])
        if not streamed:
            codes[r0:r0 + rows] = c.reshape(-1, k)
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
    if factors is not None:
        return QuantizedWeight(codes, scales, zeros, fmt, factors)
    if fmt.ternary:
        row_scales = _uniform_row_scales(nonzero, scales)
        if row_scales is not None:  # BitNet conversions: one scale per tensor, repeated in every block
            return QuantizedWeight(codes, row_scales, None, fmt.per_row())
    return QuantizedWeight(codes, scales, zeros, fmt)


def _super_blocks(factors, r0: int, r1: int, sg: int):
    """Rows ``r0:r1`` of a weight's ``factors`` a super group (a K-quant block) a row: what ``params_<type>`` reads."""
    return tuple(None if f is None else (f[0][r0:r1].reshape(-1, sg), f[1][r0:r1].reshape(-1)) for f in factors)


def _uniform_row_scales(nonzero: np.ndarray, scales: np.ndarray) -> np.ndarray | None:
    """One scale per row when, in every row, all blocks holding a nonzero ternary weight (``nonzero [M, blocks]``)
    share their scale (all-zero blocks dequantize to 0 whatever theirs is); else None."""
    f = np.where(nonzero.any(axis=1), scales[np.arange(len(scales)), nonzero.argmax(axis=1)], scales[:, 0])
    if not ((scales == f[:, None]) | ~nonzero).all():
        return None
    return f[:, None].astype(scales.dtype)
