"""Decoders of llama.cpp's block types, one per exactly imported type, named ``decode_<type>`` after the format
table's row (``tmac.base.formats``, ``GGUFBlock.decoder``). A decoder takes raw blocks ``[n, type_size]`` and the format's
code offset and returns ``(codes [n, block], scales [n, groups], zeros or None)`` with w = s·(code − offset) − z
(codebook formats: w = s·level[code]); the block layouts are described beside the table. The K-quants also have
``params_<type>``: their integer multipliers and float16 super scales as stored, ``((a, d), (b, dmin) or None)``,
from which their decoders compute the scales and zeros (and the packing takes them as they are)."""

from __future__ import annotations

import functools

import numpy as np

_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)  # TQ1_0: five base-3 digits a byte


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16)[:, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """A block's 16 bytes hold weights j (low nibble) and j + 16 (high nibble)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Bit j of a block's 4 little-endian bytes ``qh`` is the fifth bit of its weight j (Q5_0, Q5_1), as 16."""
    return (np.unpackbits(qh, axis=1, bitorder="little") << 4).astype(np.uint8)


# a type's codes and its scales and zeros apart (``codes_<type>``, ``scales_<type>``): a matrix whose codes stay in
# the file reads its parameters alone; ``decode_<type>`` composes the two (``_composed``)
def codes_q4_0(blocks, offset):
    return _nibbles(blocks[:, 2:])


def scales_q4_0(blocks, offset):  # (Q5_0, Q8_0, IQ4_NL alike)
    return _f16(blocks, 0).astype(np.float32), None


def codes_q5_0(blocks, offset):
    return _nibbles(blocks[:, 6:]) | _fifth_bits(blocks[:, 2:6])


def codes_q8_0(blocks, offset):  # w = d·q with q signed: code q + offset
    return (blocks[:, 2:].view(np.int8).astype(np.int16) + offset).astype(np.uint8)


def codes_q4_1(blocks, offset):
    return _nibbles(blocks[:, 4:])


def scales_q4_1(blocks, offset):
    d = _f16(blocks, 0).astype(np.float64)
    m = _f16(blocks, 2).astype(np.float64)
    # w = d·q + m = d·(q − offset) − z with z = −(m + offset·d); exact in float64 (both are float16 values)
    return d.astype(np.float32), -(m + offset * d)


def codes_q5_1(blocks, offset):
    return _nibbles(blocks[:, 8:]) | _fifth_bits(blocks[:, 4:8])


codes_iq4_nl = codes_q4_0  # w = d·level[q]
scales_q5_0 = scales_q8_0 = scales_iq4_nl = scales_q4_0
scales_q5_1 = scales_q4_1


def codes_iq4_xs(blocks, offset):
    return _nibbles(blocks[:, 8:].reshape(-1, 16)).reshape(-1, 256)  # w = d·(a − 32)·level[q]


def scales_iq4_xs(blocks, offset):
    low = blocks[:, 4:8]
    high = blocks[:, 2:4].copy().view("<u2")  # [n, 1]: bits 2j, 2j + 1 are group j's high scale bits
    a = _nibble_scales(low) | (((high >> np.arange(0, 16, 2, dtype=np.uint16)) & 3) << 4).astype(np.uint8)
    return _f16(blocks, 0).astype(np.float32)[:, None] * (a.astype(np.float32) - 32), None  # exact: 11 × 6 bits


_TWO_BITS = np.uint64(0x0303030303030303)


def _two_bit_fields(qs: np.ndarray, add: int = 0) -> np.ndarray:
    """``[n, 4·B]`` 2-bit fields of bytes ``qs [n, B]`` in runs of 32 bytes, plus ``add`` (at most 252): weight
    128h + 32i + l is bits 2i of byte 32h + l (TQ2_0, Q2_K, Q3_K's low bits). Eight bytes at a time (uint64): numpy
    is slow on 32-byte rows; ``add`` in the same words (no byte carries into the next), not a pass of its own."""
    n = len(qs)
    words = np.ascontiguousarray(qs).view(np.uint64).reshape(n, -1, 1, 4)  # [n, runs, 1, 4 words of a run]
    out = np.empty((n, words.shape[1], 4, 4), np.uint64)
    for i in range(4):
        np.right_shift(words[:, :, 0], np.uint64(2 * i), out=out[:, :, i])
    out &= _TWO_BITS
    if add:
        out += np.uint64(0x0101010101010101 * add)
    return out.view(np.uint8).reshape(n, -1)


def codes_tq2_0(blocks, offset):  # w = d·(q − 1)
    return _two_bit_fields(blocks[:, :64], offset - 1)


def scales_tq2_0(blocks, offset):
    return _f16(blocks, 64).astype(np.float32), None


def super_scaled(params, offset):
    """Scales (float32) and zeros (float64, or None) ``[n, groups]`` of K-quant ``params_<type>`` output: s = d·a
    (exact: 11 × at most 8 significant bits) and z = dmin·b − offset·s (w = s·q − dmin·b = s·(q − offset) − z),
    exact in float64."""
    (a, d), zero = params
    s = d.astype(np.float64)[:, None] * a
    return s.astype(np.float32), None if zero is None else zero[1].astype(np.float64)[:, None] * zero[0] - offset * s


def params_q2_k(blocks):
    sc = np.ascontiguousarray(blocks[:, :16])
    return (sc & 0x0F, _f16(blocks, 80)), (sc >> 4, _f16(blocks, 82))


def codes_q2_k(blocks, offset):
    return _two_bit_fields(blocks[:, 16:80])


def params_q3_k(blocks):
    sc = np.ascontiguousarray(blocks[:, 96:108])
    low, high = sc[:, :8], sc[:, 8:]
    a = np.concatenate([low & 0x0F, low >> 4], axis=1) | \
        (((high[:, None, :] >> np.array([0, 2, 4, 6], np.uint8)[None, :, None]) & 3) << 4).reshape(-1, 16)
    return ((a.astype(np.int16) - 32).astype(np.int8), _f16(blocks, 108)), None


def codes_q3_k(blocks, offset):
    hbit = (blocks[:, None, :32] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [n, 8, 32]: weight 32i + l
    # w = s·(q − 4·(1 − hbit)) with q the 2-bit field: code q + 4·hbit, offset 4
    return _two_bit_fields(blocks[:, 32:96]) | (hbit.reshape(-1, 256) << 2)


def params_q6_k(blocks):
    return (np.ascontiguousarray(blocks[:, 192:208]).view(np.int8), _f16(blocks, 208)), None


def codes_q6_k(blocks, offset):  # w = d·sc·(q − 32)
    ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)  # [n, h, nibble, 64]
    return (ql & 0x0F).reshape(-1, 256) | (_two_bit_fields(blocks[:, 128:192]) << 4)


def codes_tq1_0(blocks, offset):
    def trits(b, n):  # base-3 digits stored as fixed-point fractions of 256; uint8 products wrap on purpose
        t = (b.reshape(len(b), 1, -1) * _POW3[:n].reshape(1, n, 1)).reshape(len(b), -1)
        return ((t.astype(np.uint16) * 3) >> 8).astype(np.uint8)

    q = np.concatenate([trits(blocks[:, :32], 5), trits(blocks[:, 32:48], 5), trits(blocks[:, 48:52], 4)], axis=1)
    return q + (offset - 1)  # w = d·(q − 1)


def scales_tq1_0(blocks, offset):
    return _f16(blocks, 52).astype(np.float32), None


def params_q4_k(blocks):
    """The 6-bit scale and min multipliers of a Q4_K (Q5_K) block's 8 groups from its 12 bytes 4..15: bytes 0-3
    hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same for the mins, bytes 8-11 the
    low nibbles of scales 4-7 (low) and mins 4-7 (high); and d, dmin."""
    sc = np.ascontiguousarray(blocks[:, 4:16])  # (operations on a narrow strided slice are slow)
    lo, hi, mixed = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    a = np.concatenate([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], axis=1)
    b = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], axis=1)
    return (a, _f16(blocks, 0)), (b, _f16(blocks, 2))


params_q5_k = params_q4_k


def codes_q4_k(blocks, offset, qh=None):
    qs = blocks[:, -128:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(-1, 8, 32)
    if qh is not None:  # Q5_K: bit j of byte l is the fifth bit of weight l of group j
        q = q | ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4
    return q.reshape(-1, 256)


def codes_q5_k(blocks, offset):
    return codes_q4_k(blocks, offset, blocks[:, 16:48])


def _k_quant_scales(type_name: str):
    params = globals()[f"params_{type_name}"]
    return lambda blocks, offset: super_scaled(params(blocks), offset)


scales_q2_k, scales_q3_k, scales_q4_k, scales_q5_k, scales_q6_k = map(_k_quant_scales, ("q2_k", "q3_k", "q4_k",
                                                                                        "q5_k", "q6_k"))


def _composed(type_name: str):
    """``decode_<type>``: its ``codes_<type>`` and ``scales_<type>``."""
    codes, scales = globals()[f"codes_{type_name}"], globals()[f"scales_{type_name}"]

    def decode(blocks, offset):
        return codes(blocks, offset), *scales(blocks, offset)

    decode.__name__ = f"decode_{type_name}"
    return decode


for _name in ("q4_0", "q5_0", "q8_0", "q4_1", "q5_1", "iq4_nl", "iq4_xs", "tq2_0", "tq1_0", "q2_k", "q3_k", "q4_k",
              "q5_k", "q6_k"):
    globals()[f"decode_{_name}"] = _composed(_name)
del _name


# ---- the grid i-quants: indices into llama.cpp's grids, sign bits; levels as codebook codes -------------------------
# each type's levels (``WeightFormat.codebook`` of its row in ``tmac.base.formats``): sign × grid magnitude, IQ1's
# 8·(grid ± ⅛). IQ2's code is magnitude | sign << 2, IQ3's magnitude | sign << 3, IQ1_M's (grid + 1) | shift << 2
# (kernels build codes from grid indices and sign bits: ``tmac.quant.layout.GridQuads``); fillers of small magnitude
# pad them to 16 (a table's range is set by the largest level, so fillers inside it cost nothing)
_IQ2 = (8, 25, 43, 0, -8, -25, -43, 1, -5, -4, -3, -2, -1, 2, 3, 4)  # ±{0x08, 0x19, 0x2b}, then small fillers
_IQ3 = (4, 12, 20, 28, 36, 44, 52, 62)
_IQ1 = (-7, 1, 9, 0, -9, -1, 7, 2, -6, -5, -4, -3, -2, 3, 4, 5)
GRID_LEVELS = {"IQ2_XXS": _IQ2, "IQ2_XS": _IQ2, "IQ2_S": _IQ2, "IQ3_XXS": _IQ3 + tuple(-v for v in _IQ3),
               "IQ3_S": tuple(range(1, 16, 2)) + tuple(range(-1, -16, -2)), "IQ1_M": _IQ1, "IQ1_S": _IQ1}


@functools.lru_cache(maxsize=None)
def _grid(type_name: str) -> np.ndarray:
    """llama.cpp's grid of a type as integers ``[entries, width]`` (gguf-py's quants module holds it)."""
    import gguf.quants

    cls = getattr(gguf.quants, type_name)
    cls.init_grid()
    return np.rint(np.asarray(cls.grid, np.float64).reshape(cls.grid_shape)).astype(np.int16)


@functools.cache
def ksigns() -> np.ndarray:
    """The 7 stored sign bits of 8 weights and their parity as the 8th (llama.cpp's ksigns_iq2xs), as bits ``[128, 8]``."""
    seven = np.arange(128, dtype=np.uint8)
    odd = np.unpackbits(seven[:, None], axis=1).sum(axis=1) % 2
    return np.unpackbits((seven | (odd << 7).astype(np.uint8))[:, None], axis=1, bitorder="little").astype(bool)


@functools.cache
def grid_magnitude_codes(type_name: str) -> np.ndarray:
    """A sign-magnitude grid's entries ``[entries, width]`` as the indices of their magnitudes among its codebook's
    first levels (IQ2's codes are magnitude | sign << 2, IQ3_XXS's magnitude | sign << 3; IQ1_M's grid + 1 | shift
    << 2)."""
    if type_name.startswith("IQ1"):
        return (_grid(type_name) + 1).astype(np.uint8)
    levels = list(GRID_LEVELS[type_name])
    return np.vectorize(levels.index, otypes=[np.uint8])(_grid(type_name))


def _bits(b: np.ndarray) -> np.ndarray:
    """Bytes ``[n, B]`` as their bits ``[n, 8·B]``, least significant first."""
    return np.unpackbits(b, axis=1, bitorder="little").astype(bool)


def _codes(levels: np.ndarray, codebook: tuple) -> np.ndarray:
    """Integer levels ``[n, 256]`` as the codebook's codes."""
    index = np.zeros(256, np.uint8)
    index[np.asarray(codebook) + 128] = np.arange(len(codebook), dtype=np.uint8)
    return index[levels.astype(np.int16) + 128]


def _grid_codes(type_name: str, idx: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """Codes ``[n, 256]`` of grid indices ``[n, E]`` with one sign bit a weight (``negative [n, 256]``)."""
    mags = _grid(type_name)[idx].reshape(len(idx), -1)
    return _codes(np.where(negative, -mags, mags), GRID_LEVELS[type_name])


def _scale(d: np.ndarray, s: np.ndarray, shift: int) -> np.ndarray:
    """``d·(2s + 1)·2^shift`` in float32, exactly (11 × 5 significant bits, a power of two)."""
    return d[:, None] * (2 * s.astype(np.float32) + 1) * np.float32(2.0 ** shift)


def _nibble_scales(sc: np.ndarray) -> np.ndarray:
    """Bytes of two 4-bit scales as ``[n, 2·B]``: low nibble first."""
    return np.stack([sc & 0x0F, sc >> 4], axis=2).reshape(len(sc), -1)


def _seven_bit_signs(words: np.ndarray) -> np.ndarray:
    """u32 words ``[n, W]`` of four 7-bit sign indices (bits 0, 7, 14, 21) as 8 sign bits each: ``[n, 32·W]``."""
    seven = (words[:, :, None] >> np.array([0, 7, 14, 21], np.uint32)) & 0x7F
    return ksigns()[seven].reshape(len(words), -1)


def decode_iq2_xxs(blocks, offset):
    q = blocks[:, 2:66].copy().view("<u4").reshape(-1, 8, 2)  # per 32: indices, signs and scale
    idx = q[:, :, 0].copy().view(np.uint8).reshape(len(blocks), -1)
    codes = _grid_codes("IQ2_XXS", idx, _seven_bit_signs(q[:, :, 1]))
    return codes, _scale(_f16(blocks, 0).astype(np.float32), q[:, :, 1] >> 28, -3), None


def decode_iq2_xs(blocks, offset):
    q = blocks[:, 2:66].copy().view("<u2")  # [n, 32]: per 8 weights
    codes = _grid_codes("IQ2_XS", q & 511, ksigns()[q >> 9].reshape(len(blocks), -1))
    return codes, _scale(_f16(blocks, 0).astype(np.float32), _nibble_scales(blocks[:, 66:74]), -3), None


def decode_iq2_s(blocks, offset):
    high = (blocks[:, 66:74, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3  # [n, 8, 4]: entry 4j + i
    idx = blocks[:, 2:34].astype(np.uint16) | (high.reshape(len(blocks), -1).astype(np.uint16) << 8)
    codes = _grid_codes("IQ2_S", idx, _bits(blocks[:, 34:66]))
    return codes, _scale(_f16(blocks, 0).astype(np.float32), _nibble_scales(blocks[:, 74:82]), -3), None


def decode_iq3_xxs(blocks, offset):
    ss = blocks[:, 66:98].copy().view("<u4")  # [n, 8]: per 32
    codes = _grid_codes("IQ3_XXS", blocks[:, 2:66], _seven_bit_signs(ss))
    return codes, _scale(_f16(blocks, 0).astype(np.float32), ss >> 28, -2), None


def decode_iq3_s(blocks, offset):
    idx = blocks[:, 2:66].astype(np.uint16) | (_bits(blocks[:, 66:74]).astype(np.uint16) << 8)
    codes = _grid_codes("IQ3_S", idx, _bits(blocks[:, 74:106]))
    return codes, _scale(_f16(blocks, 0).astype(np.float32), _nibble_scales(blocks[:, 106:110]), 0), None


def _iq1_codes(type_name: str, idx: np.ndarray, minus: np.ndarray) -> np.ndarray:
    """IQ1: level 8·grid + 1, or − 1 where the entry's delta is −⅛ (``minus [n, E]``, one a grid entry)."""
    levels = 8 * _grid(type_name)[idx] + np.where(minus, -1, 1)[:, :, None]
    return _codes(levels.reshape(len(idx), -1), GRID_LEVELS[type_name])


# IQ1_S as a K-quant of 2-bit codes q = grid + 1 (its deltas are one a group of 32, as a K-quant's min):
# w = d·(2s + 1)·(grid ± ⅛) = d·a·q − (d/8)·b with a = 2s + 1 and b = 7a (delta +⅛) or 9a (−⅛): the file's 1.56 bits
# a weight held at 2.6 instead of 4.3 as codebook codes, exactly (IQ1_M's deltas are one per 8 weights: codes)
def _iq1_s_qh(blocks):
    return blocks[:, 34:50].copy().view("<u2")  # [n, 8]: per 32, 4 × 3 index bits, s (3 bits), the delta's sign


def params_iq1_s(blocks):
    qh = _iq1_s_qh(blocks)
    a = (2 * ((qh >> 12) & 7) + 1).astype(np.uint8)
    b = a * np.where((qh & 0x8000) != 0, 9, 7).astype(np.uint8)
    d = _f16(blocks, 0).astype(np.float32)
    return (a, d), (b, d / np.float32(8))  # (d/8 in float32: exact; stored float16 where it is one)


def codes_iq1_s(blocks, offset):
    high = (_iq1_s_qh(blocks)[:, :, None] >> np.array([0, 3, 6, 9], np.uint16)) & 7
    idx = blocks[:, 2:34].astype(np.uint16) | (high.reshape(len(blocks), -1) << 8)
    return (_grid("IQ1_S")[idx] + 1).astype(np.uint8).reshape(len(blocks), -1)


scales_iq1_s = _k_quant_scales("iq1_s")
decode_iq1_s = _composed("iq1_s")


def decode_iq1_m(blocks, offset):
    sc = blocks[:, 48:56].copy().view("<u2")  # [n, 4]: 4 × 3-bit scales, and a nibble of d's bits each
    d = ((sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00) | (sc[:, 3] & 0xF000))
    s = ((sc[:, :, None] >> np.array([0, 3, 6, 9], np.uint16)) & 7).reshape(len(blocks), -1)  # per 16
    nib = _nibble_scales(blocks[:, 32:48])  # per 8: 3 index bits, the delta's sign
    idx = blocks[:, :32].astype(np.uint16) | ((nib & 7).astype(np.uint16) << 8)
    return _iq1_codes("IQ1_M", idx, (nib & 8) != 0), _scale(d.view(np.float16).astype(np.float32), s, -3), None
