"""Grid i-quants expanded in registers (``tmac.quant.layout.GridQuads``): the grid indices and sign bytes of a pair
of vectors' 32 rows and one step become the quads' code bytes that the lookups and the dot products read — byte
4i + p of row i holds code p | code p + 4 << 4, a code being magnitude | sign << b.

A grid entry is a 16-bit word of its magnitudes, looked up as two tables of 256 to 1024 bytes (its low and its high
byte; ``permute2`` reads 128 entries, blends on the index's eighth bit and on its ninth and tenth pick the part:
IQ2_XS's ninth is in the row's second byte, beside 7 signs whose byte ``permute2`` looks up; IQ3_S's and IQ2_S's are
lane masks). A ``permute2`` a vector puts two rows' words side by side in an 8-byte lane, from which ``multishift``
windows cut each code byte's fields:

- IQ2_XXS, IQ2_XS, IQ2_S (an entry a step, eight 2-bit magnitudes): magnitude p at bit ``OFFSETS[p]`` of the word and
  p + 4 four bits above, so one window holds both (bits 0-1, 4-5); the row's sign byte beside the words gives signs p
  and p + 4 (bits 2, 6) in a second window.
- IQ3_XXS, IQ3_S (two entries a step, four 3-bit magnitudes each, in the word's nibbles): the sign bits go into the
  nibbles' free top bits first (each word's bytes from its row's sign byte, shifted by a window), so that nibble p of
  the step's first word is code p and of its second code p + 4; a window on each puts them in one byte.
"""

from __future__ import annotations

import numpy as np

from tmac.codegen.vectors import constant, vec
from tmac.quant.layout import seven_bit_signs

OFFSETS = (0, 2, 8, 10)
ROWS = 16  # a vector's rows: 4 code bytes each; a pair of vectors' grid bytes are one load
# IQ2, vector h of pair q, its rows 2j, 2j + 1 (8-byte lane j): their words' low and high bytes, their sign bytes
# (from the pair's low bytes beside its signs, and the high bytes, where pair q's are lanes 32q-: ``permute2``), then
# two unused bytes
PLACE = [[[at for j in range(ROWS // 2) for r in (ROWS * h + 2 * j,) for hi in (64 + 32 * q + r,)
           for at in (r, hi, r + 1, hi + 1, 32 + r, 33 + r, 0, 0)] for h in (0, 1)] for q in (0, 1)]
# byte 4e + p of lane j (row 2j + e): magnitudes p, p + 4 from the row's word; its signs p (bit 2) and p + 4 (bit 6)
MAGNITUDE_BITS = [16 * e + OFFSETS[p] for _ in range(ROWS // 2) for e in (0, 1) for p in range(4)]
SIGN_BITS = [8 * (4 + e) + p - 2 for _ in range(ROWS // 2) for e in (0, 1) for p in range(4)]
# IQ3_XXS: entry e of pair row r is lane 2r + e; its sign byte spread to both lanes, then shifted so that the low byte
# takes signs 4e, 4e + 1 at bits 3, 7 (the sign byte's order: ``layout.SIGN_ORDER``) and the high byte 4e + 2, 4e + 3
# (a window from bit 8·(lane mod 8) − k is the lane's byte shifted left by k, rotating in bits from above)
SPREAD_SIGNS = [r for r in range(32) for _ in (0, 1)]
SIGN_SHIFTS = [[(8 * (lane % 8) - (first - 2 * (lane % 2))) % 64 for lane in range(64)] for first in (3, 2)]
# vector h, rows 2j, 2j + 1: the words of their two entries (low, high byte each), in order
PLACE_ENTRIES = [[at for j in range(ROWS // 2) for r in (ROWS * h + 2 * j, ROWS * h + 2 * j + 1) for e in (0, 1)
                  for at in (2 * r + e, 64 + 2 * r + e)] for h in (0, 1)]
# byte 4e + p of lane j (row 2j + e): nibble p of its first word (bits 0-3), of its second (bits 4-7)
FIRST_NIBBLES = [32 * e + 4 * p for _ in range(ROWS // 2) for e in (0, 1) for p in range(4)]
SECOND_NIBBLES = [32 * e + 12 + 4 * p for _ in range(ROWS // 2) for e in (0, 1) for p in range(4)]


def entry_words(magnitudes: np.ndarray) -> np.ndarray:
    """The grid's entries ``[entries, width]`` (magnitude codes) as the 16-bit words described above."""
    m = magnitudes.astype(np.uint16)
    words = np.zeros(len(m), np.uint16)
    if m.shape[1] == 4:  # nibble p: magnitude p
        for p in range(4):
            words |= m[:, p] << (4 * p)
        return words
    for p, at in enumerate(OFFSETS):
        words |= (m[:, p] << at) | (m[:, p + 4] << (at + 4))
    return words


def expanded_pairs(isa, layout, buf, starts, shifts=None):
    """The quads' code bytes (uint8x64, a vector's) of the pairs of vectors whose grid bytes start at ``starts`` of
    ``buf``: 32 rows' indices (an entry or two a row), then their sign bytes. Two pairs of IQ2 and IQ1 (an entry a
    row: their indices fill half a vector) share each lookup, pair q's rows in lanes 32q-. IQ1: ``shifts`` are the
    pairs' rows' multiplier bytes of the step's group and the step's entry in that group (its shift: bit 4 + e)."""
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    def u8(value):
        return tirx.Broadcast(tirx.IntImm("uint8", value), 64)

    def table(values):  # 64 bytes as 8 int64 lanes: a shuffle of 64 byte broadcasts took LLVM seconds to fold
        lanes = np.asarray(values, np.uint8).view("<i8").tolist()
        return tirx.reinterpret("uint8x64", constant(lanes, "int64"))

    def halves(part):  # lanes 32·part- of each pair's load: the indices (0), the sign bytes (1)
        return tirx.Shuffle(loads, [64 * q + 32 * part + i for q in range(2) for i in range(32)])

    def picked(bit, parts):  # each two parts (bit clear, set) as one, bound: small expressions compile fast
        return [T.bind(tirx.Select(bit, b, a)) for a, b in zip(parts[0::2], parts[1::2])]

    pairs = len(starts)
    if pairs not in (1, 2) or pairs == 2 and layout.entries != 1:
        raise ValueError(f"{layout.grid}: {pairs} pairs of vectors in one expansion")
    if layout.shifts:  # IQ1: 32 index bytes a pair, its masks after them
        loads = [buf[vec(at, 32)] for at in starts]
        grid = tirx.Shuffle(loads * (3 - pairs), list(range(64)))
    else:
        loads = [buf[vec(at, 64)] for at in starts]
        grid = loads[0] if pairs == 1 else halves(0)
        signs = loads[0] if pairs == 1 else halves(1)  # (a pair's at lanes 32-, two pairs' at 0- and 32-)

    def lane_mask(h):  # the pairs' mask h after their indices (and signs) as one of 64 lanes
        held = [buf[vec(at + layout.masks_at + 4 * layout.entries * h, 4 * layout.entries)] for at in starts]
        if layout.entries == 1:  # 4 bytes a pair
            held = [tirx.Shuffle(held * (3 - pairs), list(range(8)))]
        return isa.lane_mask(held[0])
    words = entry_words(layout.magnitudes())
    top = tirx.reinterpret("int8x64", grid) < tirx.Broadcast(tirx.IntImm("int8", 0), 64)  # index bit 7: entries 128+
    grid = T.bind(grid)
    low, high = ([isa.permute2(grid, table(half[q:q + 64]), table(half[q + 64:q + 128]))
                  for q in range(0, len(words), 128)] for half in (words & 255, words >> 8))
    low, high = picked(top, low), picked(top, high)
    for h in range(layout.masks):  # IQ3_S, IQ2_S, IQ1: index bit 8 + h a lane mask (IQ2, IQ1: 32 lanes a pair)
        bit = lane_mask(h)
        low, high = picked(bit, low), picked(bit, high)
    if layout.shifts:  # IQ1: an entry's shift is the "sign" of its 8 weights
        held, entry = shifts
        if pairs == 1:
            held = tirx.Shuffle([held, held], list(range(64)))
        bit = tirx.Cast("uint8", tirx.IntImm("int32", 16) << entry)
        signs = tirx.Select((tirx.reinterpret("uint8x64", held) & tirx.Broadcast(bit, 64)) != u8(0), u8(255), u8(0))
    if layout.ninth_in_signs:  # IQ2_XS: the ninth bit, and 7 signs above it, in each row's second byte
        second = signs if pairs == 2 else tirx.Shuffle([grid, grid], list(range(32, 64)) * 2)
        ninth = (second & u8(1)) != u8(0)
        low, high = picked(ninth, low), picked(ninth, high)
        seven = tirx.reinterpret("uint8x64", tirx.reinterpret("uint16x32", signs) >> tirx.Broadcast(
            tirx.IntImm("uint16", 1), 32))  # (bit 7 from the next byte: ``permute2`` reads bits 0-6)
        table_signs = seven_bit_signs()
        signs = isa.permute2(seven, table(table_signs[:64]), table(table_signs[64:]))
    (low,), (high,) = low, high
    out = []
    if layout.width == 4:
        signs = buf[vec(starts[0] + 64, 32)]
        spread = tirx.Shuffle([signs, signs], SPREAD_SIGNS)
        low, high = (word | (isa.multishift(table(shifts), spread) & u8(0x88))
                     for word, shifts in zip((low, high), SIGN_SHIFTS))
        for h in (0, 1):
            placed = isa.permute2(table(PLACE_ENTRIES[h]), low, high)
            out.append((isa.multishift(table(FIRST_NIBBLES), placed) & u8(0x0F)) |
                       (isa.multishift(table(SECOND_NIBBLES), placed) & u8(0xF0)))
        return out
    for q in range(pairs):
        at = 32 * q if pairs == 2 else 32  # the pair's sign bytes in ``signs``
        beside = tirx.Shuffle([low, signs], [32 * q + i for i in range(32)] + [64 + at + i for i in range(32)])
        for h in (0, 1):
            placed = isa.permute2(table(PLACE[q][h]), beside, high)
            magnitudes = isa.multishift(table(MAGNITUDE_BITS), placed)
            signs_of = isa.multishift(table(SIGN_BITS), placed)
            out.append((magnitudes & u8(0x33)) | (signs_of & u8(0x44)))
    return out
