"""Grid i-quants expanded in registers (``tmac.quant.layout.GridQuads``): the grid indices and sign bytes of a vector's
16 rows and one step become the quads' code bytes that the lookups and the dot products read — byte 4i + p of row i
holds code p | code p + 4 << 4, a code being magnitude | sign << 2.

A grid entry is a 16-bit word of 2-bit magnitudes, magnitude p at bit ``OFFSETS[p]`` and p + 4 four bits above, so
that one ``multishift`` window of 8 bits holds magnitude p in its bits 0-1 and p + 4 in bits 4-5. The words' low and
high bytes are two tables of 256, looked up a quarter (64 entries of each) at a time by ``permute2``, whose index
bit 6 picks the high bytes' table in the lanes that want them; the index's top two bits pick the quarter."""

from __future__ import annotations

import numpy as np

from tmac.codegen.vectors import constant, vec

OFFSETS = (0, 2, 8, 10)
ROWS = 16  # a vector's rows: 4 code bytes each; a pair of vectors' grid bytes are one load
# vector h of a pair, its rows 2j, 2j + 1 (8-byte lane j): their words' low and high bytes, their sign bytes (from the
# pair's low bytes beside its signs, and its high bytes: ``permute2``), then two unused bytes
PLACE = [[at for j in range(ROWS // 2) for r in (ROWS * h + 2 * j,) for at in (r, 64 + r, r + 1, 65 + r, 32 + r, 33 + r,
                                                                              0, 0)] for h in (0, 1)]
# byte 4e + p of lane j (row 2j + e): magnitudes p, p + 4 from the row's word; its signs p (bit 2) and p + 4 (bit 6)
MAGNITUDE_BITS = [16 * e + OFFSETS[p] for _ in range(ROWS // 2) for e in (0, 1) for p in range(4)]
SIGN_BITS = [8 * (4 + e) + p - 2 for _ in range(ROWS // 2) for e in (0, 1) for p in range(4)]


def entry_words(magnitudes: np.ndarray) -> np.ndarray:
    """The grid's entries ``[entries, 8]`` (2-bit magnitude codes) as the 16-bit words described above."""
    m = magnitudes.astype(np.uint16)
    words = np.zeros(len(m), np.uint16)
    for p, at in enumerate(OFFSETS):
        words |= (m[:, p] << at) | (m[:, p + 4] << (at + 4))
    return words


def expanded_pair(isa, layout, buf, at):
    """The quads' code bytes (uint8x64) of the two vectors whose 64 grid bytes start at byte ``at`` of ``buf``: 32
    rows' indices, then their sign bytes."""
    from tvm import tirx

    def u8(value):
        return tirx.Broadcast(tirx.IntImm("uint8", value), 64)

    def table(values):  # 64 bytes as 8 int64 lanes: a shuffle of 64 byte broadcasts took LLVM seconds to fold
        lanes = np.asarray(values, np.uint8).view("<i8").tolist()
        return tirx.reinterpret("uint8x64", constant(lanes, "int64"))

    words = entry_words(layout.magnitudes())
    grid = buf[vec(at, 64)]
    top = tirx.reinterpret("int8x64", grid) < tirx.Broadcast(tirx.IntImm("int8", 0), 64)  # index bit 7: entries 128+
    low, high = ([isa.permute2(grid, table(half[q:q + 64]), table(half[q + 64:q + 128])) for q in (0, 128)]
                 for half in (words & 255, words >> 8))
    low, high = (tirx.Select(top, b, a) for a, b in (low, high))
    low = tirx.Shuffle([low, grid], list(range(32)) + list(range(96, 128)))  # the low bytes, then the signs
    out = []
    for h in (0, 1):
        placed = isa.permute2(table(PLACE[h]), low, high)
        magnitudes = isa.multishift(table(MAGNITUDE_BITS), placed)
        signs = isa.multishift(table(SIGN_BITS), placed)
        out.append((magnitudes & u8(0x33)) | (signs & u8(0x44)))
    return out
