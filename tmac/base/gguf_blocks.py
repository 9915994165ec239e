"""Decoders of llama.cpp's block types, one per exactly imported type, named ``decode_<type>`` after the format
table's row (``tmac.base.formats``, ``GGUFBlock.decoder``). A decoder takes raw blocks ``[n, type_size]`` and the format's
code offset and returns ``(codes [n, block], scales [n, groups], zeros or None)`` with w = s·(code − offset) − z
(codebook formats: w = s·level[code]); the block layouts are described beside the table."""

from __future__ import annotations

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


def decode_q4_0(blocks, offset):
    return _nibbles(blocks[:, 2:]), _f16(blocks, 0).astype(np.float32), None


def decode_q5_0(blocks, offset):
    return _nibbles(blocks[:, 6:]) | _fifth_bits(blocks[:, 2:6]), _f16(blocks, 0).astype(np.float32), None


def decode_q8_0(blocks, offset):
    # w = d·q with q signed: code q + offset
    return (blocks[:, 2:].view(np.int8).astype(np.int16) + offset).astype(np.uint8), \
        _f16(blocks, 0).astype(np.float32), None


def decode_q4_1(blocks, offset, codes=None):
    d = _f16(blocks, 0).astype(np.float64)
    m = _f16(blocks, 2).astype(np.float64)
    # w = d·q + m = d·(q − offset) − z with z = −(m + offset·d); exact in float64 (both are float16 values)
    return _nibbles(blocks[:, 4:]) if codes is None else codes, d.astype(np.float32), -(m + offset * d)


def decode_q5_1(blocks, offset):
    return decode_q4_1(blocks, offset, _nibbles(blocks[:, 8:]) | _fifth_bits(blocks[:, 4:8]))


def decode_iq4_nl(blocks, offset):
    return _nibbles(blocks[:, 2:]), _f16(blocks, 0).astype(np.float32), None  # w = d·level[q]


def decode_iq4_xs(blocks, offset):
    low = blocks[:, 4:8]
    high = blocks[:, 2:4].copy().view("<u2")  # [n, 1]: bits 2j, 2j + 1 are group j's high scale bits
    a = np.stack([low & 0x0F, low >> 4], axis=2).reshape(-1, 8) | \
        (((high >> np.arange(0, 16, 2, dtype=np.uint16)) & 3) << 4).astype(np.uint8)
    s = _f16(blocks, 0).astype(np.float32)[:, None] * (a.astype(np.float32) - 32)  # exact: 11 × 6 bits
    return _nibbles(blocks[:, 8:].reshape(-1, 16)).reshape(-1, 256), s, None  # w = d·(a − 32)·level[q]


def _two_bit_fields(qs: np.ndarray) -> np.ndarray:
    """``[n, 4·B]`` 2-bit fields of bytes ``qs [n, B]`` in runs of 32 bytes: weight 128h + 32i + l is bits 2i of
    byte 32h + l (TQ2_0, Q2_K, Q3_K's low bits)."""
    fields = qs.reshape(len(qs), -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return (fields & 3).reshape(len(qs), -1)


def decode_tq2_0(blocks, offset):
    return _two_bit_fields(blocks[:, :64]) + (offset - 1), _f16(blocks, 64).astype(np.float32), None  # w = d·(q − 1)


def decode_q2_k(blocks, offset):
    sc = blocks[:, :16]
    s = _f16(blocks, 80).astype(np.float64)[:, None] * (sc & 0x0F)  # exact: 11 × 4 significant bits
    # w = s·q − dmin·b = s·(q − offset) − z with z = dmin·b − offset·s; exact in float64
    return _two_bit_fields(blocks[:, 16:80]), s.astype(np.float32), \
        _f16(blocks, 82).astype(np.float64)[:, None] * (sc >> 4) - offset * s


def decode_q3_k(blocks, offset):
    low, high = blocks[:, 96:104], blocks[:, 104:108]
    a = np.concatenate([low & 0x0F, low >> 4], axis=1) | \
        (((high[:, None, :] >> np.array([0, 2, 4, 6], np.uint8)[None, :, None]) & 3) << 4).reshape(-1, 16)
    s = _f16(blocks, 108).astype(np.float32)[:, None] * (a.astype(np.float32) - 32)  # exact: 11 × 6 bits
    hbit = (blocks[:, None, :32] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [n, 8, 32]: weight 32i + l
    # w = s·(q − 4·(1 − hbit)) with q the 2-bit field: code q + 4·hbit, offset 4
    return _two_bit_fields(blocks[:, 32:96]) | (hbit.reshape(-1, 256) << 2), s, None


def decode_q6_k(blocks, offset):
    ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)  # [n, h, nibble, 64]
    q = (ql & 0x0F).reshape(-1, 256) | (_two_bit_fields(blocks[:, 128:192]) << 4)
    s = _f16(blocks, 208).astype(np.float32)[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return q, s, None  # w = d·sc·(q − 32): exact scales (11 × 8 bits)


def decode_tq1_0(blocks, offset):
    def trits(b, n):  # base-3 digits stored as fixed-point fractions of 256; uint8 products wrap on purpose
        t = (b.reshape(len(b), 1, -1) * _POW3[:n].reshape(1, n, 1)).reshape(len(b), -1)
        return ((t.astype(np.uint16) * 3) >> 8).astype(np.uint8)

    q = np.concatenate([trits(blocks[:, :32], 5), trits(blocks[:, 32:48], 5), trits(blocks[:, 48:52], 4)], axis=1)
    return q + (offset - 1), _f16(blocks, 52).astype(np.float32), None  # w = d·(q − 1)


def decode_q4_k(blocks, offset, qh=None):
    a, b = _q4_k_scales(blocks[:, 4:16])
    s = _f16(blocks, 0).astype(np.float64)[:, None] * a  # exact: 11 × 6 significant bits
    qs = blocks[:, -128:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(-1, 8, 32)
    if qh is not None:  # Q5_K: bit j of byte l is the fifth bit of weight l of group j
        q = q | ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4
    # w = s·q − dmin·b = s·(q − offset) − z with z = dmin·b − offset·s; exact in float64
    return q.reshape(-1, 256), s.astype(np.float32), _f16(blocks, 2).astype(np.float64)[:, None] * b - offset * s


def decode_q5_k(blocks, offset):
    return decode_q4_k(blocks, offset, blocks[:, 16:48])


def _q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scale and min multipliers of a Q4_K block's 8 groups from its 12 bytes: bytes 0-3 hold scales
    0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same for the mins, bytes 8-11 the low nibbles
    of scales 4-7 (low) and mins 4-7 (high)."""
    lo, hi, mixed = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    a = np.concatenate([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], axis=1)
    b = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], axis=1)
    return a.astype(np.float64), b.astype(np.float64)
