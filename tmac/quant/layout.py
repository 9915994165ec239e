"""How a kernel's weight bytes are laid out: one small class per layout, owning its shapes, its packer and unpacker,
and what the code generator asks of it. ``KernelSpec.layout`` is the one a spec uses (``layout_of``).

A layout arranges *codes*, which say what a table index means: ``PlaneCodes``, one bit plane of ``b``-bit codes
indexing the table of 4 activations, ``TripleCodes``, three ternary weights to an index plus a sign, or
``CodebookCodes``, a 4-bit code indexing its own activation's table of products with a codebook's levels
(``tmac.base.reference`` derives all three). ``Planes`` and ``Triples`` look up 16-entry tables a nibble at a time;
``Quads`` does 64-entry lookups, four tables at once, for either kind of codes.

Common to all: rows are processed in blocks of ``block_rows`` (BM) and K in *steps* (the inner loop's unit);
a packed weight is ``W [MB = ceil(M/BM), K'/step, step_bytes·BM]`` uint8, K' = ``k_padded(K)``, padded rows and
activations being weight 0. Scales, zeros and the order of K chunks are ``tmac.execution.packing``'s.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod

import numpy as np

from tmac.base.reference import LUT_GROUPS, SIGNS, TRIPLE_COEFFS, TRIPLE_LUT_GROUP, padded_k, plane_nibbles, triple_indices

CHUNKS = {1: ((0, 1),), 2: ((0, 2),), 3: ((0, 2), (2, 1)), 4: ((0, 4),), 5: ((0, 4), (4, 1)), 6: ((0, 4), (4, 2)),
          8: ((0, 4), (4, 4))}  # bits → ((first plane, planes), ...)

QUAD_CHUNKS = {1: ((0, 1, 0),), 2: ((0, 2, 0),), 3: ((0, 2, 0), (0, 2, 4), (2, 1, 0)),
               5: ((0, 2, 0), (0, 2, 4), (2, 2, 0), (2, 2, 4), (4, 1, 0))}  # index planes → ((plane, P, table), ...)

UNPACK_ROWS = 4096  # rows unpacked at a time: the temporaries are ~5x the codes (a tied 8-bit head's: 140 MB at once)


def quad_step(planes: int) -> int:
    """Activations a quad step of ``planes`` index planes covers (4 per table; a chunk of P planes covers 8/P tables
    from its first): 16 at 2 planes, else 32."""
    return 4 * max(t0 + 8 // p for _, p, t0 in QUAD_CHUNKS[planes])


# ---- codes: what a table index means --------------------------------------------------------------------------------
class PlaneCodes:
    """The bit planes of ``bits``-bit codes: bit j of plane i's index into the table of activations 4t .. 4t+3 is
    bit i of code 4t+j; entry p is ½·Σ_j ±x_j with the signs of p's bits (``tmac.base.reference.SIGNS``)."""

    per_table = 4  # activations a table covers
    coefficients = SIGNS  # entry p of a table is Σ_j coefficients[p, j]·x_j (halved: ``table_sum``)
    pad_code = 0  # of padded rows, whose scales are 0
    symmetric = False  # the epilogue subtracts (½s + z)·Σx of each weight group
    negated = False  # no sign flags
    suffix = ""  # in the kernel's name

    def __init__(self, bits: int):
        self.bits = self.planes = bits  # index planes per table

    def k_padded(self, k: int) -> int:
        return k

    @staticmethod
    def table_sum(t, half):
        """An entry of the products ``t`` = coefficient·x, in the fp32 order of ``tmac.base.reference``; ``half`` is
        0.5 as the caller's type."""
        return half * ((t[0] + t[1]) + (t[2] + t[3]))

    @classmethod
    def largest(cls, t, half):
        """A table's largest |entry| from ``t`` = |x| (the entry whose signs all agree: rounding is monotonic)."""
        return cls.table_sum(t, half)

    def problems(self, spec) -> list[str]:
        k, g, lg = spec.k, spec.group_size, spec.lut_group
        if lg not in LUT_GROUPS or k % lg or g % lg:
            return [f"lut_group={lg} must be one of {LUT_GROUPS} and divide K={k} and the group size {g}"]
        return []

    def accepts(self, fmt, scale_groups: int = 1) -> bool:
        """Whether weights of format ``fmt`` with ``scale_groups`` scales a row take these codes."""
        return True

    def indices(self, codes: np.ndarray, k_padded: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Table indices ``[planes, rows, K'/per_table]`` of codes ``[rows, K]``, and the sign flags (or None)."""
        return plane_nibbles(codes, self.bits), None

    def codes_of(self, nib: np.ndarray, neg, k: int) -> np.ndarray:
        """Codes ``[rows, k]`` of ``indices``' output (its inverse)."""
        bits, rows, t = nib.shape
        codes = np.zeros((rows, 4 * t), dtype=np.uint8)
        for plane in range(bits):
            for j in range(4):
                codes[:, j::4] |= ((nib[plane] >> j) & 1) << plane
        return codes


class TripleCodes:
    """Ternary weights (2-bit codes 1..3, one scale per row) three to a table: a 4-bit index of the 14 patterns
    up to negation and a sign flag (``tmac.base.reference``: 1.67 bits per weight). K is padded with zero activations
    to whole lut groups (``TRIPLE_LUT_GROUP``)."""

    per_table = 3
    coefficients = TRIPLE_COEFFS
    pad_code = 2  # weight 0
    symmetric = True  # no Σx term
    negated = True  # sign flags follow the indices
    suffix = "_t3"
    bits, planes = 2, 1
    VERSION = 2  # of the packed triple bytes (2: flags as bit masks), stored with saved weights

    k_padded = staticmethod(padded_k)

    @staticmethod
    def table_sum(t, half):
        return (t[0] + t[1]) + t[2]

    largest = PlaneCodes.__dict__["largest"]

    def problems(self, spec) -> list[str]:
        if (spec.bits, spec.has_zeros, spec.group_size, spec.lut_group) != (2, False, spec.k, TRIPLE_LUT_GROUP):
            return [f"triples need 2-bit codes without zeros, one scale per row (group_size = K) and "
                    f"lut_group {TRIPLE_LUT_GROUP}"]
        return []

    def accepts(self, fmt, scale_groups: int = 1) -> bool:
        return fmt.ternary and scale_groups == 1

    def indices(self, codes: np.ndarray, k_padded: int) -> tuple[np.ndarray, np.ndarray]:
        idx, neg = triple_indices(codes, k_padded)
        return idx[None], neg

    def codes_of(self, nib: np.ndarray, neg: np.ndarray, k: int) -> np.ndarray:
        idx = nib[0]
        e = np.where(neg, 26 - idx.astype(np.int16), idx).astype(np.uint8)  # 9·d0 + 3·d1 + d2, digits d = code − 1
        digits = np.stack([e // 9, e // 3 % 3, e % 3], axis=2).reshape(idx.shape[0], -1)
        return digits[:, :k] + 1


class CodebookCodes:
    """4-bit codes of a codebook format (``WeightFormat.codebook``), each the index into its own activation's table
    ``T_k[p] = c_p·x_k``: one plane, one activation a table, symmetric (no Σx term)."""

    per_table = 1
    pad_code = 0  # of padded rows, whose scales are 0
    symmetric = True
    negated = False
    bits, planes = 4, 1

    def __init__(self, levels: tuple):
        self.levels = tuple(levels)
        self.coefficients = np.asarray(levels, np.float32).reshape(16, 1)
        self.suffix = ""  # (the spec's name carries the levels': ``_cb<hash>``)

    def k_padded(self, k: int) -> int:
        return k

    @staticmethod
    def table_sum(t, half):
        return t[0]

    def largest(self, t, half):
        # |c_p·x| is largest at the level of largest magnitude (rounding is monotonic); 2·half·max = max exactly
        return t[0] * (half * float(2 * max(abs(c) for c in self.levels)))

    def problems(self, spec) -> list[str]:
        if spec.bits != 4 or spec.has_zeros or spec.triples:
            return ["codebook kernels take 4-bit codes without zeros, in bit-plane or quad bytes (no triples)"]
        return PlaneCodes.problems(self, spec)  # (the same lut groups as bit planes)

    def accepts(self, fmt, scale_groups: int = 1) -> bool:
        return fmt.codebook == self.levels

    def indices(self, codes: np.ndarray, k_padded: int) -> tuple[np.ndarray, None]:
        return np.ascontiguousarray(codes)[None], None

    def codes_of(self, nib: np.ndarray, neg, k: int) -> np.ndarray:
        return nib[0, :, :k]


# ---- layouts: where the indices go ----------------------------------------------------------------------------------
class Layout(ABC):
    """What every layout answers. ``chunks``: (first plane, bytes a row owns in a weight vector) of each run of
    planes the ISA sums in one instruction; ``step_tables``: tables a step covers; ``step_bytes``: a row's bytes per
    step. The ``lookups``/``mask_start`` hooks tell the code generator where a step's indices and flags are."""

    wide_lookup = False  # 64-entry lookups, one serving four tables
    quad_chunks: tuple = ()
    shifts = False  # IQ1's grid: an entry's shift held above its group's multiplier (``GridQuads.shift_bits``)
    chunks: tuple
    step_tables: int
    step_bytes: int

    def __init__(self, codes):
        self.codes = codes

    @property
    def suffix(self) -> str:
        return self.codes.suffix

    @property
    def row_bytes(self) -> int:
        """Bytes of one row in the weight vectors of one lookup (all chunks)."""
        return sum(planes for _, planes in self.chunks)

    @property
    def step_activations(self) -> int:
        return self.step_tables * self.codes.per_table

    def stored_bytes(self, vector_bytes: int) -> int:
        """Bytes of W a weight vector of ``vector_bytes`` is read from (expanded from fewer: ``GridQuads``)."""
        return vector_bytes

    def accepts(self, fmt, scale_groups: int = 1) -> bool:
        """Whether weights of format ``fmt`` with ``scale_groups`` scales a row take this layout: its codes'."""
        return self.codes.accepts(fmt, scale_groups)

    def step_vectors(self, block_rows: int, vector_bytes: int) -> int:
        """Weight vectors a block of ``block_rows`` rows reads per step."""
        return block_rows * self.row_bytes // vector_bytes * max(1, len(self.quad_chunks))

    def weight_shape(self, blocks: int, k: int, block_rows: int) -> tuple[int, int, int]:
        return blocks, self.codes.k_padded(k) // self.step_activations, self.step_bytes * block_rows

    def problems(self, spec) -> list[str]:
        return self.codes.problems(spec)

    @abstractmethod
    def lookups(self, step, block_rows: int) -> list[tuple]:
        """Per lookup of a step: (first table of the low nibbles', of the high nibbles', first weight byte of the
        indices, planes P and first plane of a quad chunk, whose bytes are weighted 2^(first + p mod P))."""

    def mask_start(self, j: int, v, h: int, block_rows: int, vector_bytes: int):
        """First byte of the sign mask of lookup j's low (h = 0) or high nibbles, vector v (``codes.negated``)."""
        raise TypeError(f"{type(self).__name__} of {type(self.codes).__name__} has no sign masks")

    @abstractmethod
    def pack(self, codes: np.ndarray, spec) -> np.ndarray:
        """W rows ``[blocks, steps, step_bytes·BM]`` of whole row blocks of codes ``[blocks·BM, K]``."""

    @abstractmethod
    def unpack(self, w: np.ndarray, spec) -> np.ndarray:
        """Codes ``[MB·BM, K]`` of W in block-major order (the inverse of ``pack``)."""


class Planes(Layout):
    """Bit planes, a table pair (8 activations: one table per nibble of a byte) a step. The ``bits`` planes are
    split into chunks of 1, 2 or 4 planes (3 bits = 2 + 1) because the ISAs sum 1, 2 or 4 adjacent bytes of a row in
    one instruction (widening add, ``pmaddubsw``, ``vpdpbusd``/``sdot``)::

        W [MB, K/8, BM·bits]  uint8

    Within one ``[blk, step]`` row of BM·bits bytes, chunk c (planes ``o_c .. o_c+P_c−1``) occupies bytes
    ``[BM·o_c, BM·(o_c+P_c))``, cut into vectors of VL bytes (the ISA's vector width). Byte ``l`` of vector ``v``
    of that chunk belongs to row ``v·(VL/P_c) + l // P_c`` of the block and plane ``o_c + l % P_c``; its low
    nibble is the table index of that plane for activations ``8·step .. +3`` and its high nibble for
    ``8·step+4 .. +7``. Padded rows are code 0. Codebook codes are one plane of one activation a table: a step is
    activations ``2·step`` (low nibble) and ``2·step + 1`` (high), ``W [MB, K/2, BM]``."""


    step_tables = 2

    def __init__(self, codes: PlaneCodes | CodebookCodes):
        super().__init__(codes)
        self.chunks = CHUNKS.get(codes.planes, ())
        self.step_bytes = codes.planes

    def lookups(self, step, block_rows):
        return [(2 * step, 2 * step + 1, 0, None, 0)]

    def pack(self, codes, spec):
        bm, vl, k, bits = spec.block_rows, spec.vector_bytes, spec.k, self.codes.planes
        mb, steps = codes.shape[0] // bm, k // self.step_activations
        if isinstance(self.codes, PlaneCodes):
            return _plane_steps(codes, spec, self.chunks)
        nib, _ = self.codes.indices(codes, k)  # [planes, rows, tables]
        pair = nib[:, :, 0::2] | (nib[:, :, 1::2] << 4)  # [planes, rows, steps]: low nibble table 2s, high 2s+1
        pair = pair.reshape(bits, mb, bm, steps)
        parts = []
        for first, planes in self.chunks:
            per_vec = vl // planes
            # [planes, MB, BM, steps] → [MB, steps, vectors, rows-in-vector, planes]
            c = pair[first:first + planes].reshape(planes, mb, bm // per_vec, per_vec, steps)
            parts.append(c.transpose(1, 4, 2, 3, 0).reshape(mb, steps, bm * planes))
        return np.concatenate(parts, axis=2)

    def unpack(self, w, spec):
        bm = spec.block_rows
        step = max(1, UNPACK_ROWS // bm)  # a few blocks at a time
        codes = np.empty((w.shape[0] * bm, spec.k), dtype=np.uint8)
        for b in range(0, w.shape[0], step):
            codes[b * bm:(b + step) * bm] = self._unpack_block_rows(w[b:b + step], spec)
        return codes

    def _unpack_block_rows(self, w, spec):
        bm, vl, mb, k, bits = spec.block_rows, spec.vector_bytes, w.shape[0], spec.k, self.codes.planes
        steps = k // self.step_activations
        pair = np.empty((bits, mb, bm, steps), dtype=np.uint8)
        start = 0
        for first, planes in self.chunks:
            per_vec = vl // planes
            c = w[:, :, start:start + bm * planes].reshape(mb, steps, bm // per_vec, per_vec, planes)
            pair[first:first + planes] = c.transpose(4, 0, 2, 3, 1).reshape(planes, mb, bm, steps)
            start += bm * planes
        nib = np.empty((bits, mb * bm, 2 * steps), dtype=np.uint8)
        nib[:, :, 0::2] = pair.reshape(bits, mb * bm, steps) & 15
        nib[:, :, 1::2] = pair.reshape(bits, mb * bm, steps) >> 4
        return self.codes.codes_of(nib, None, k)


_BYTE_BITS = np.uint64(0x0101010101010101)
_GATHER = np.uint64(0x0102040810204080)  # (x & _BYTE_BITS) · _GATHER >> 56: bit j is bit 0 of x's byte j (no carries)
_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32}
GATHER_ROWS = 64  # rows gathered at a time: the temporaries stay in L2


def _plane_steps(codes: np.ndarray, spec, chunks) -> np.ndarray:
    """``Planes``' W of bit-plane codes ``[MB·BM, K]``, as its docstring lays it out, computed word-wise: a step's
    8 codes are one uint64 whose bit plane p gathers into one byte (its low nibble the table index of codes 0-3,
    its high of 4-7); a chunk's P planes of one row and step are one P-byte word, and a block's words go to their
    vectors in one transposing copy."""
    bm, vl = spec.block_rows, spec.vector_bytes
    m, k = codes.shape
    mb, steps = m // bm, k // 8
    runs = np.ascontiguousarray(codes).view("<u8")
    out = np.empty((mb, steps, bm * sum(planes for _, planes in chunks)), np.uint8)
    at = 0
    for first, planes in chunks:
        word = _WORDS[planes]
        words = np.empty((m, steps), word)
        t, acc = np.empty((GATHER_ROWS, steps), np.uint64), np.empty((GATHER_ROWS, steps), np.uint64)
        for r0 in range(0, m, GATHER_ROWS):
            src = runs[r0:r0 + GATHER_ROWS]
            tt, aa = t[:len(src)], acc[:len(src)]
            for p in range(planes):
                np.right_shift(src, np.uint64(first + p), out=tt)
                tt &= _BYTE_BITS
                tt *= _GATHER
                tt >>= np.uint64(56)
                if p:  # plane p's byte at byte p of the word
                    tt <<= np.uint64(8 * p)
                    aa |= tt
                else:
                    aa[...] = tt
            words[r0:r0 + GATHER_ROWS] = aa
        per_vec = vl // planes  # rows a vector: [MB, vectors, rows in vector, steps] → [MB, steps, vectors, rows]
        out[:, :, at:at + bm * planes].view(word).reshape(mb, steps, bm // per_vec, per_vec)[...] = \
            words.reshape(mb, bm // per_vec, per_vec, steps).transpose(0, 3, 1, 2)
        at += bm * planes
    return out


class Triples(Layout):
    """Ternary triples (``TripleCodes``) in 16-entry lookups, 8 triples = 4 table pairs a step (24
    activations)::

        W [MB, Kp/24, 5·BM]  uint8

    Bytes ``[j·BM, (j+1)·BM)`` of a ``[blk, step]`` row hold table pair j (j < 4): byte r is row r of the block,
    its low nibble the index of triple ``8·step + 2j``, its high nibble of triple ``8·step + 2j + 1``. Bytes
    ``[4·BM, 5·BM)`` hold the negation flags as bit masks, VL/8 bytes each: mask ``b`` of vector v starts at byte
    ``4·BM + v·VL + b·VL/8``, and its bit l (little-endian) negates the lookup of triple ``8·step + b`` by row
    ``v·VL + l`` (AVX-512 loads a mask straight into a k register)."""

    chunks = ((0, 1),)
    step_tables = 8
    step_bytes = 5

    def lookups(self, step, block_rows):
        return [(8 * step + 2 * j, 8 * step + 2 * j + 1, j * block_rows, None, 0) for j in range(4)]

    def mask_start(self, j, v, h, block_rows, vector_bytes):
        return 4 * block_rows + v * vector_bytes + (2 * j + h) * vector_bytes // 8

    def pack(self, codes, spec):
        bm, kp, vl = spec.block_rows, spec.k_padded, spec.vector_bytes
        mb, steps = codes.shape[0] // bm, kp // 24
        (idx,), neg = self.codes.indices(codes, kp)  # [rows, Kp/3]
        pair = (idx[:, 0::2] | (idx[:, 1::2] << 4)).reshape(mb, bm, steps, 4).transpose(0, 2, 3, 1)
        # [MB, vectors, VL rows, steps, 8 triples] → [MB, steps, vectors, 8 masks, VL bits]
        flags = neg.reshape(mb, bm // vl, vl, steps, 8).transpose(0, 3, 1, 4, 2)
        masks = np.packbits(flags, axis=4, bitorder="little").reshape(mb, steps, bm)
        return np.concatenate([pair.reshape(mb, steps, 4 * bm), masks], axis=2)

    def unpack(self, w, spec):
        bm, vl, mb, steps = spec.block_rows, spec.vector_bytes, w.shape[0], spec.k_padded // 24
        pair = w[:, :, :4 * bm].reshape(mb, steps, 4, bm).transpose(0, 3, 1, 2).reshape(mb * bm, steps * 4)
        idx = np.stack([pair & 15, pair >> 4], axis=2).reshape(mb * bm, steps * 8)
        masks = w[:, :, 4 * bm:].reshape(mb, steps, bm // vl, 8, vl // 8)
        flags = np.unpackbits(masks, axis=4, bitorder="little")  # [MB, steps, vectors, 8, VL]
        neg = flags.transpose(0, 2, 4, 1, 3).reshape(mb * bm, steps * 8).astype(bool)
        return self.codes.codes_of(idx[None], neg, spec.k)


_LOW_HALF = np.uint64(0xFFFFFFFF)
_FOUR_BYTE_BITS = np.uint64(0x01010101)
_GATHER4 = np.uint32(0x01020408)  # (x & 0x01010101) · _GATHER4 >> 24: bit j is bit 0 of x's byte j


def _one_plane_quads(idx: np.ndarray, neg: np.ndarray | None, mb: int, nv: int, per: int, steps: int) -> np.ndarray:
    """``Quads``' W of one plane of 8 tables a step (indices ``idx [rows, 8·steps]``, flags ``neg`` or None), as its
    docstring lays it out, word-wise: a row's 8 indices of a step are one uint64 whose halves (tables 0-3, 4-7)
    become the low and high nibbles of its 4 bytes, one uint32 moved to its vector by a transposing copy; a row's
    flags of a step gather into two nibbles (tables 0-3, 4-7), two rows' nibbles a mask byte."""
    bm = nv * per
    out = np.empty((mb, steps, 4 * bm + (bm if neg is not None else 0)), np.uint8)
    v = np.ascontiguousarray(idx).view("<u8")  # [rows, steps]
    words = ((v & _LOW_HALF) | ((v >> np.uint64(32)) << np.uint64(4))).astype(np.uint32)
    out[:, :, :4 * bm].view(np.uint32).reshape(mb, steps, nv, per)[...] = \
        words.reshape(mb, nv, per, steps).transpose(0, 3, 1, 2)
    if neg is not None:
        flags = np.ascontiguousarray(neg).view(np.uint8).view("<u8")  # [rows, steps]: byte 4h + p, table 4h + p
        masks = out[:, :, 4 * bm:].reshape(mb, steps, nv, 2, per // 2)
        for h in range(2):
            nib = ((((flags >> np.uint64(32 * h)) & _FOUR_BYTE_BITS).astype(np.uint32) * _GATHER4) >> np.uint32(24))
            nib = nib.astype(np.uint8).reshape(mb, nv, per // 2, 2, steps)  # rows 2j, 2j + 1 of a vector
            masks[:, :, :, h] = (nib[:, :, :, 0] | (nib[:, :, :, 1] << 4)).transpose(0, 3, 1, 2)
    return out


class Quads(Layout):
    """64-entry lookups (``vpermb``), four tables at once, of 1-, 2-, 3- or 5-bit planes or of triples. A step's
    weights are cut into *quad chunks* (``QUAD_CHUNKS``: first plane o, planes P, first table t0). In a chunk every
    row owns 4 adjacent bytes of a vector, which hold its P bit planes (P = 1 or 2) of 4/P tables per nibble, so
    one lookup serves four tables and one ``vpdpbusd`` sums a row's four bytes (weighted 2^(o + p mod P): 1;
    1, 2, 1, 2; or 4), every chunk into the same accumulator. A step covers T tables: 8 (32 activations; 24 for
    triples), or 4 (16 activations) at 2 bits, whose one chunk holds both planes of 4 tables. At 1 bit and for
    triples the one chunk is plane 0 of 8 tables; at 3 bits planes 0-1 of tables 0-3, planes 0-1 of tables 4-7,
    then plane 2 of all 8; at 5 bits the same for planes 0-1 and 2-3, then plane 4 of all 8::

        W [MB, K/32, 4·BM]  uint8           (1 bit)
        W [MB, K/16, 4·BM]  uint8           (2 bits)
        W [MB, K/32, 12·BM] uint8           (3 bits)
        W [MB, K/32, 20·BM] uint8           (5 bits)
        W [MB, Kp/24, 5·BM] uint8           (triples)

    Chunk c occupies bytes ``[4·BM·c, 4·BM·(c+1))`` of a ``[blk, step]`` row. Its byte ``4i + p`` of vector v
    (VL/4 rows) belongs to row ``v·VL/4 + i`` of the block and plane ``o + p mod P``; the low nibble indexes table
    ``T·step + t0 + p div P``, the high nibble table ``T·step + t0 + 4/P + p div P``. Triples append their negation
    flags, two masks of VL/8 bytes per vector: mask h of vector v starts at byte ``4·BM + v·VL/4 + h·VL/8`` and
    its bit ``4i + p`` negates the lookup of table ``8·step + 4h + p`` by row ``v·VL/4 + i``."""

    wide_lookup = True
    chunks = ((0, 4),)

    def __init__(self, codes):
        super().__init__(codes)
        self.quad_chunks = QUAD_CHUNKS.get(codes.planes, ())
        self.step_tables = quad_step(codes.planes) // 4 if self.quad_chunks else 0
        self.step_bytes = 4 * len(self.quad_chunks) + (1 if codes.negated else 0)

    @property
    def suffix(self) -> str:
        return self.codes.suffix + "_q4"

    def problems(self, spec):
        if spec.vector_bytes != 64 or not self.quad_chunks:
            return [f"quads need {sorted(QUAD_CHUNKS)}-bit weights or triples and 64-byte vectors"]
        return super().problems(spec)

    def lookups(self, step, block_rows):
        t = self.step_tables * step
        return [(t + t0, t + t0 + (4 if planes == 1 else 0), 4 * block_rows * c, planes, first)
                for c, (first, planes, t0) in enumerate(self.quad_chunks)]

    def mask_start(self, j, v, h, block_rows, vector_bytes):
        return 4 * block_rows + v * vector_bytes // 4 + h * vector_bytes // 8

    def pack(self, codes, spec):
        bm, vl, tables = spec.block_rows, spec.vector_bytes, self.step_tables
        mb, nv = codes.shape[0] // bm, bm * 4 // vl
        nib, neg = self.codes.indices(codes, spec.k_padded)
        steps = nib.shape[2] // tables
        if self.quad_chunks == ((0, 1, 0),):  # one plane of 8 tables (1 bit, triples): word-wise
            return _one_plane_quads(nib[0], neg, mb, nv, vl // 4, steps)
        nib = nib.reshape(nib.shape[0], mb, nv, vl // 4, steps, tables)
        parts = []
        for first, planes, t0 in self.quad_chunks:
            # [P, MB, vectors, VL/4 rows, steps, low/high nibble, table] → [MB, steps, vectors, rows, low/high, table, P]
            c = nib[first:first + planes, ..., t0:t0 + 8 // planes]
            q = c.reshape(planes, mb, nv, vl // 4, steps, 2, 4 // planes).transpose(1, 4, 2, 3, 5, 6, 0)
            parts.append((q[..., 0, :, :] | (q[..., 1, :, :] << 4)).reshape(mb, steps, 4 * bm))
        if neg is not None:
            flags = neg.reshape(mb, nv, vl // 4, steps, 2, 4).transpose(0, 3, 1, 4, 2, 5).reshape(mb, steps, nv, 2, vl)
            parts.append(np.packbits(flags, axis=4, bitorder="little").reshape(mb, steps, bm))
        return np.concatenate(parts, axis=2)

    def unpack(self, w, spec):
        bm, vl, tables, (mb, steps, _) = spec.block_rows, spec.vector_bytes, self.step_tables, w.shape
        nv = bm * 4 // vl
        nib = np.empty((self.codes.planes, mb, nv, vl // 4, steps, tables), dtype=np.uint8)
        for c, (first, planes, t0) in enumerate(self.quad_chunks):
            q = w[:, :, 4 * bm * c:4 * bm * (c + 1)].reshape(mb, steps, nv, vl // 4, 1, 4 // planes, planes)
            q = np.concatenate([q & 15, q >> 4], axis=4)  # [MB, steps, vectors, rows, low/high, table, P]
            nib[first:first + planes, ..., t0:t0 + 8 // planes] = \
                q.transpose(6, 0, 2, 3, 1, 4, 5).reshape(planes, mb, nv, vl // 4, steps, 8 // planes)
        nib = nib.reshape(nib.shape[0], mb * bm, steps * tables)
        neg = None
        if self.codes.negated:
            masks = w[:, :, 4 * bm:].reshape(mb, steps, nv, 2, vl // 8)
            flags = np.unpackbits(masks, axis=4, bitorder="little").reshape(mb, steps, nv, 2, vl // 4, 4)
            neg = flags.transpose(0, 2, 4, 1, 3, 5).reshape(mb * bm, steps * 8).astype(bool)
        return self.codes.codes_of(nib, neg, spec.k)


# grid i-quants held as their indices: weights an entry covers (a step's 8, or 4: two indices a step), the bits of a
# magnitude code (codes are magnitude | sign << bits) and of an index (9: a grid of 512 — IQ2_XS's ninth bit shares a
# byte with 7 sign bits, the 8th their parity, as in the file; IQ3_S's ninth bits and IQ2_S's ninth and tenth follow
# a pair of vectors' signs; IQ1's 2048 entries (IQ1_M's, and IQ1_S's held as IQ1_M's codes: ``tmac.quant.held``) are
# magnitudes grid + 1, its three high bits and its shifts follow its indices)
GRID_TYPES = {"IQ2_XXS": (8, 2, 8), "IQ3_XXS": (4, 3, 8), "IQ2_XS": (8, 2, 9), "IQ3_S": (4, 3, 9), "IQ2_S": (8, 2, 10),
              "IQ1_M": (8, 2, 11), "IQ1_S": (8, 2, 11)}
# IQ1's multiplier bits below its entries' shifts (``GridQuads.shift_bits``)
SHIFT_MULTIPLIER = 15
# the bit order of a step's sign byte: IQ3_XXS's holds signs 0, 2, 4, 6, 1, 3, 5, 7, so that the kernel puts each
# pair its nibbles need 4 bits apart in one shift
SIGN_ORDER = {8: tuple(range(8)), 4: (0, 2, 4, 6, 1, 3, 5, 7)}


@functools.cache
def _entry_index(grid: str, bits: int) -> np.ndarray:
    """A grid's entry index by its magnitudes as a key of ``bits`` a weight (magnitude p at bit bits·p; -1: no
    entry): what packing looks each step's codes up in."""
    from tmac.base.gguf_blocks import grid_magnitude_codes

    entries = grid_magnitude_codes(grid)
    index_of = np.full(1 << (bits * entries.shape[1]), -1, np.int16)
    index_of[(entries.astype(np.int32) << (bits * np.arange(entries.shape[1], dtype=np.int32))).sum(axis=1)] = \
        np.arange(len(entries), dtype=np.int16)
    return index_of


@functools.cache
def _sign_order(width: int) -> np.ndarray:
    """A byte's 8 bits (bit p: weight p's sign) in ``SIGN_ORDER[width]``: uint8 ``[256]``."""
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
    return np.packbits(bits[:, list(SIGN_ORDER[width])], axis=1, bitorder="little")[:, 0]


def seven_bit_signs() -> np.ndarray:
    """llama.cpp's sign bytes of 7 sign bits (the 8th their parity), by the 7 bits: uint8 ``[128]``."""
    from tmac.base.gguf_blocks import ksigns

    return np.packbits(ksigns(), axis=1, bitorder="little")[:, 0]


class GridQuads(Quads):
    """Quads of codebook codes held as llama.cpp's grid indices and sign bits (``GRID_TYPES``): a row's E index bytes
    (E = 8 / entry width: 1 for IQ2 and IQ1, 2 for IQ3_XXS and IQ3_S) and a sign byte a step instead of four
    code bytes, which the kernel expands into the quads' code bytes (``tmac.codegen.grids``). A code is
    magnitude | sign << b, the magnitude the index of the grid value among the codebook's first levels::

        W [MB, K/8, P·BM/32]  uint8      (P = (E + 1)·32 bytes a pair of vectors, 8 more for IQ3_S and IQ2_S)

    A pair of vectors' rows (VL/2, 32) has P bytes of a ``[blk, step]`` row, from byte ``P·v``: byte E·i + e is (the
    low 8 bits of) entry e of row ``32·v + i`` for activations ``8·step + 8e/E ..``, byte E·32 + i the row's sign bits
    (bit k: activation ``8·step + SIGN_ORDER[k]`` negative) — IQ2_XS's instead the index's ninth bit and 7 sign bits
    above it (the 8th sign their parity: other signs are refused) — and IQ3_S's and IQ2_S's higher index bits then
    follow as lane masks, 8 bytes: bit E·i + e of the little-endian 32·E bits of mask h is bit 8 + h of index
    E·i + e (IQ3_S one mask of 64, IQ2_S two of 32). IQ1 (IQ1_M, and IQ1_S as its codes) has no sign bytes: its
    code is (grid + 1) | shift << 2, the shift (−⅛) one an entry, held in its group's multiplier byte
    (``shift_bits``), so the masks of its three high index bits follow the indices (P = 44)."""

    def __init__(self, codes: CodebookCodes, grid: str):
        super().__init__(codes)
        self.grid = grid
        self.width, self.magnitude_bits, self.index_bits = GRID_TYPES.get(grid, (8, 2, 8))
        self.entries = 8 // self.width  # a row's indices a step
        # IQ2_XS's ninth index bit shares a byte with 7 signs; IQ3_S's, IQ2_S's and IQ1's high bits are lane masks
        self.ninth_in_signs = self.index_bits == 9 and self.width == 8
        self.masks = 0 if self.ninth_in_signs else self.index_bits - 8
        # IQ1: an entry's "sign" is its shift (−⅛), one bit an entry, held in its group's multiplier byte above the
        # multiplier (``shift_bits``), so no sign bytes
        self.shifts = grid.startswith("IQ1")
        self.masks_at = 32 * self.entries + (0 if self.shifts else 32)  # (in a pair's bytes)
        self.pair_bytes = self.masks_at + 4 * self.entries * self.masks
        self.step_bytes = self.pair_bytes / 32  # (3.25 for IQ3_S: a block's rows are whole pairs)

    @property
    def suffix(self) -> str:
        return super().suffix + "g"

    def stored_bytes(self, vector_bytes: int) -> int:
        return self.pair_bytes // 2

    def weight_shape(self, blocks: int, k: int, block_rows: int) -> tuple[int, int, int]:
        return blocks, k // 8, self.pair_bytes * block_rows // 32

    def problems(self, spec):
        if self.grid not in GRID_TYPES:
            return [f"grid {self.grid!r:.20} is not one of {tuple(GRID_TYPES)}"]
        from tmac.base.gguf_blocks import GRID_LEVELS

        if self.codes.levels != GRID_LEVELS[self.grid]:
            return [f"grid {self.grid} takes its own codebook {GRID_LEVELS[self.grid]}"]
        if spec.block_rows % (spec.vector_bytes // 2):
            return [f"grid quads take blocks of whole vector pairs ({spec.vector_bytes // 2} rows)"]
        return super().problems(spec)

    def accepts(self, fmt, scale_groups: int = 1) -> bool:
        return super().accepts(fmt, scale_groups) and fmt.gguf is not None and fmt.gguf.type_name == self.grid

    def magnitudes(self) -> np.ndarray:
        """The grid's entries as magnitude codes ``[entries, width]``."""
        from tmac.base.gguf_blocks import grid_magnitude_codes

        return grid_magnitude_codes(self.grid)

    def pack(self, codes, spec):
        bm, per, e, bits = spec.block_rows, spec.vector_bytes // 2, self.entries, self.magnitude_bits
        rows, k = codes.shape
        mb, steps = rows // bm, k // 8
        c = np.ascontiguousarray(codes).reshape(rows, steps, 8)
        step = c.view("<u8")[:, :, 0]  # a step's 8 codes as one word: byte p code p
        byte = np.uint64(0x0101010101010101)
        key = np.zeros((rows, steps, e), np.int32)
        for p in range(8):  # entry p // width's key: magnitude p mod width at bit bits·(p mod width)
            field = ((step >> np.uint64(8 * p)) & np.uint64((1 << bits) - 1)).astype(np.int32)
            key[:, :, p // self.width] |= field << (bits * (p % self.width))
        idx = _entry_index(self.grid, bits)[key]  # [rows, steps, E]: −1 where no entry has those magnitudes
        bad = (idx < 0).any(axis=2) | (step & ~(byte * np.uint64((2 << bits) - 1)) != 0)  # (above magnitude | sign)
        if bad.any():
            r, s = np.argwhere(bad)[0]
            raise ValueError(f"codes {c[r, s].tolist()} (row {r}, activations {8 * s}-{8 * s + 7}) are no entries of "
                             f"{self.grid}'s grid with signs")
        # bit ``bits`` of each byte gathered into one byte (bit p: byte p's; a multiply's sum without carries), then
        # put in ``SIGN_ORDER``
        gathered = ((step >> np.uint64(bits)) & byte) * np.uint64(0x0102040810204080) >> np.uint64(56)
        signs = _sign_order(self.width)[gathered.astype(np.uint8)]
        if self.shifts:  # one shift an entry: its 8 weights' "signs" alike
            mixed = (signs != 0) & (signs != 255)
            if mixed.any():
                r, s = np.argwhere(mixed)[0]
                raise ValueError(f"codes {c[r, s].tolist()} (row {r}, activations {8 * s}-{8 * s + 7}) mix "
                                 f"{self.grid}'s two shifts in one grid entry")
        if self.ninth_in_signs:  # the ninth index bit, then the first 7 signs; the 8th
            odd = np.unpackbits(signs[:, :, None], axis=2).sum(axis=2) % 2 != 0  # must be their parity
            if odd.any():
                r, s = np.argwhere(odd)[0]
                raise ValueError(f"codes {c[r, s].tolist()} (row {r}, activations {8 * s}-{8 * s + 7}) have an odd "
                                 f"count of negative signs, which {self.grid}'s 7 sign bits cannot hold")
            signs = ((idx[:, :, 0] >> 8) | ((signs & 0x7F) << 1)).astype(np.uint8)
        out = np.empty((mb, steps, self.pair_bytes * bm // per), np.uint8)
        v = out.reshape(mb, steps, bm // per, self.pair_bytes)
        pairs = idx.reshape(mb, bm // per, per, steps, e).transpose(0, 3, 1, 2, 4).reshape(mb, steps, bm // per, e * per)
        v[..., :e * per] = pairs.astype(np.uint8)
        signs = signs.reshape(mb, bm // per, per, steps).transpose(0, 3, 1, 2)
        if not self.shifts:
            v[..., e * per:(e + 1) * per] = signs
        for h in range(self.masks):
            at = self.masks_at + h * e * per // 8
            v[..., at:at + e * per // 8] = np.packbits((pairs >> (8 + h)) & 1, axis=3, bitorder="little")
        return out

    def shift_bits(self, codes: np.ndarray, group_size: int) -> np.ndarray:
        """IQ1: the shifts of each group's entries as its multiplier's bits 4 and up (``[rows, K/group]`` uint8),
        which the kernels read beside the multiplier (its bits 0-3); codes are checked by ``pack``."""
        rows, k = codes.shape
        per = group_size // 8
        shift = ((codes[:, ::8] >> self.magnitude_bits) & 1).reshape(rows, k // group_size, per)
        return (shift << (4 + np.arange(per, dtype=np.uint8))).sum(axis=2, dtype=np.uint8)

    def with_shifts(self, codes: np.ndarray, multipliers: np.ndarray, group_size: int) -> np.ndarray:
        """``unpack``'s codes with the shifts of ``multipliers`` (bits 4 and up, ``[rows, K/group]``) put back."""
        per = group_size // 8
        bits = (multipliers[:, :, None].astype(np.uint8) >> (4 + np.arange(per, dtype=np.uint8))) & 1
        return codes | (np.repeat(bits.reshape(len(codes), -1), 8, axis=1) << self.magnitude_bits).astype(np.uint8)

    def unpack(self, w, spec):
        bm, per, e, (mb, steps, _) = spec.block_rows, spec.vector_bytes // 2, self.entries, w.shape
        v = w.reshape(mb, steps, bm // per, self.pair_bytes)
        idx = v[..., :e * per].astype(np.int32)
        for h in range(self.masks):
            at = self.masks_at + h * e * per // 8
            idx |= np.unpackbits(v[..., at:at + e * per // 8], axis=3, bitorder="little").astype(np.int32) << (8 + h)
        idx = idx.reshape(mb, steps, bm // per, per, e).transpose(0, 2, 3, 1, 4).reshape(mb * bm, steps, e)
        signs = np.zeros((mb * bm, steps), np.uint8) if self.shifts else \
            v[..., e * per:(e + 1) * per].transpose(0, 2, 3, 1).reshape(mb * bm, steps)  # (IQ1's: ``with_shifts``)
        if self.ninth_in_signs:
            idx = idx | ((signs & 1).astype(np.int32) << 8)[:, :, None]
            signs = seven_bit_signs()[signs >> 1]
        neg = np.empty((mb * bm, steps, 8), np.uint8)
        neg[:, :, list(SIGN_ORDER[self.width])] = np.unpackbits(signs[:, :, None], axis=2, bitorder="little")
        mags = self.magnitudes()[idx].reshape(mb * bm, steps, 8)
        return (mags | (neg << self.magnitude_bits)).reshape(mb * bm, 8 * steps)


def layout_of(bits: int, triples: bool, quads: bool, codebook: tuple = (), grid: str = "") -> Layout:
    """The layout of a spec's ``bits``, ``triples``, ``quads``, ``codebook`` and ``grid`` fields."""
    if grid:
        return GridQuads(CodebookCodes(codebook), grid)
    if codebook:  # (its codes refuse triples: ``CodebookCodes.problems``)
        return Quads(CodebookCodes(codebook)) if quads else Planes(CodebookCodes(codebook))
    codes = TripleCodes() if triples else PlaneCodes(bits)
    return Quads(codes) if quads else Triples(codes) if triples else Planes(codes)
