"""The byte layout of packed weights, described here and only here, and the packer that produces it.

A kernel variant is a ``KernelSpec``. Rows are processed in blocks of ``block_rows`` (BM); activations in
*table pairs* of 8 (two 4-activation tables, one per nibble of a byte). The ``bits`` bit planes are split into
*chunks* of 1, 2 or 4 planes (3 bits = 2 + 1) because the ISAs sum 1, 2 or 4 adjacent bytes of a row in one
instruction (widening add, ``pmaddubsw``, ``vpdpbusd``/``sdot``).

    W [MB = ceil(M/BM), K/8, BM·bits]  uint8

Within one ``[blk, kp]`` row of BM·bits bytes, chunk c (planes ``o_c .. o_c+P_c−1``) occupies bytes
``[BM·o_c, BM·(o_c+P_c))``, cut into vectors of VL bytes (the ISA's vector width). Byte ``l`` of vector ``v`` of
that chunk belongs to row ``v·(VL/P_c) + l // P_c`` of the block and plane ``o_c + l % P_c``; its low nibble is the
table index of that plane for activations ``8kp .. 8kp+3`` and its high nibble for ``8kp+4 .. 8kp+7`` (bit j of a
nibble = the plane bit of activation j of the run). Padded rows are code 0.

    S, Z [MB, K/WG, BM]  float16 or float32, as the spec says (scale, zero of row ``blk·BM + r`` for weight
                         group g; per-row: WG = K)

With ``super_groups`` = SG > 0 (formats with a ``super_group``: llama.cpp's K-quants), scales and zeros are
integer multiples of one *super scale* per SG groups of a row, and S and Z hold those, a super group at a time:

    S, Z [MB, K/(WG·SG), (SG + F)·BM]  uint8 (S of a format without zeros: int8)

Byte ``[blk, j, i·BM + r]`` (i < SG) is the multiplier a (of S) or b (of Z) of row r's group ``j·SG + i``; bytes
``SG·BM ..`` of ``[blk, j]`` are the super scales ``[BM]`` in the spec's ``scale_dtype`` (F bytes each: float16,
as llama.cpp stores d and dmin, where every one is a float16 value, else float32): d (of S) or m (of Z) of super
group j of each row. The scale is d·a and the zero m·b − offset·d·a, both exact in float32; without zeros (Q3_K,
Q6_K) a is signed.

Tables are ``LUT [N', K/4, 16]`` int8, their scales ``LS [N', K/LG]`` and activation sums ``XS [N', K/WG]``
float32, with N' = N rounded up to the kernel's row tile.

*Triples* (``triples=True``; ternary weights with one scale per row, see ``tmac.reference``; the default on ISAs
with quads, ``uses_triples``): K is padded to
Kp (whole lut groups), and a *step* is 24 activations = 8 triples = 4 table pairs:

    W [MB, Kp/24, 5·BM]  uint8

Bytes ``[j·BM, (j+1)·BM)`` of a ``[blk, step]`` row hold table pair j (j < 4): byte r is row r of the block, its
low nibble the index of triple ``8·step + 2j``, its high nibble of triple ``8·step + 2j + 1``. Bytes
``[4·BM, 5·BM)`` hold the negation flags as bit masks, VL/8 bytes each: mask ``b`` of vector v starts at byte
``4·BM + v·VL + b·VL/8``, and its bit l (little-endian) negates the lookup of triple ``8·step + b`` by row
``v·VL + l`` (AVX-512 loads a mask straight into a k register). Padded rows and activations are weight 0.
``S [MB, 1, BM]``; tables ``LUT [N', Kp/3, 16]``, ``LS [N', Kp/LG]``, ``XS [N', 1]`` (unused by the GEMM:
ternary codes need no Σx term).

*Quads* (``quads=True``; 1- to 3-bit weights and triples on ISAs with 64-entry lookups, ``vpermb``): a step's
weights are cut into *quad chunks* (``QUAD_CHUNKS``: first plane o, planes P, first table t0). In a chunk every row
owns 4 adjacent bytes of a vector, which hold its P bit planes (P = 1 or 2) of 4/P tables per nibble, so one lookup
serves four tables and one ``vpdpbusd`` sums a row's four bytes (weighted 2^(o + p mod P): 1; 1, 2, 1, 2; or 4),
with no interleaving, every chunk into the same accumulator. A step covers T tables: 8 (32 activations; 24 for
triples), or 4 (16 activations) at 2 bits, whose one chunk holds both planes of 4 tables. At 1 bit and for
triples the one chunk is plane 0 of 8 tables; at 3 bits planes 0-1 of tables 0-3, planes 0-1 of tables 4-7, then
plane 2 of all 8; at 5 bits the same for planes 0-1 and 2-3, then plane 4 of all 8:

    W [MB, K/32, 4·BM]  uint8           (1 bit)
    W [MB, K/16, 4·BM]  uint8           (2 bits)
    W [MB, K/32, 12·BM] uint8           (3 bits)
    W [MB, K/32, 20·BM] uint8           (5 bits)
    W [MB, Kp/24, 5·BM] uint8           (triples)

Chunk c occupies bytes ``[4·BM·c, 4·BM·(c+1))`` of a ``[blk, step]`` row. Its byte ``4i + p`` of vector v (VL/4
rows) belongs to row ``v·VL/4 + i`` of the block and plane ``o + p mod P``; the low nibble indexes table
``T·step + t0 + p div P``, the high nibble table ``T·step + t0 + 4/P + p div P``. Triples append their negation
flags, two masks of VL/8 bytes per vector: mask h of vector v starts at byte ``4·BM + v·VL/4 + h·VL/8`` and its
bit ``4i + p`` negates the lookup of table ``8·step + 4h + p`` by row ``v·VL/4 + i``.

*K chunks* (``k_chunk``: a whole number of lut groups, and of weight or super groups where a row has several):
the kernels take K a chunk at a time across all blocks, so that the chunk's tables stay in L1 while the blocks
stream. W, and S and Z where they span K, keep the shapes above, but their ``[MB, R, X]`` rows (R: steps, groups or
super groups) are stored chunk by chunk: chunk c of rows ``[r0, r0 + n)`` (the last chunk may be shorter) is an
``[MB, n, X]`` array after the chunks before it, so row r of block b is flat row ``MB·r0 + b·n + (r − r0)``. With
one chunk (``k_chunk`` = Kp, the default on 32-byte vectors and on 64-byte ones but for triples and W1) that is
the plain ``[MB, R, X]`` order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .choose import spec_and_factors, super_dtype
from .formats import PER_TENSOR, WeightFormat
from .kquant import factor_params
from .qweight import QuantizedWeight
from .reference import plane_nibbles, triple_indices
from .spec import KernelSpec, packed_shapes

TRIPLES_LAYOUT = 2  # of the packed triple bytes (2: flags as bit masks), stored with saved weights
PACK_WEIGHTS = 1 << 21  # codes packed at a time: the layout's temporaries, ~15 bytes a code, stay ~30 MiB


def pack_for(qw: QuantizedWeight, isa, **tiling) -> PackedWeight:
    """``pack(qw, spec_for(qw, isa, **tiling))``, factoring K-quant parameters once, not twice."""
    spec, factors = spec_and_factors(qw, isa, tiling)
    return pack(qw, spec, factors)


@dataclass(frozen=True)
class PackedWeight:
    """Weights in a kernel's layout. ``m`` is the true row count (W, S, Z are padded to whole blocks)."""

    spec: KernelSpec
    m: int
    weights: np.ndarray  # uint8 [MB, K/8, BM·bits]; triples [MB, Kp/24, 5·BM]; quads [MB, K/4T, 4·chunks·BM]
    scales: np.ndarray  # spec.param_dtypes[0] [MB, K/WG, BM] (super scales: [MB, K/(WG·SG), (SG + F)·BM])
    zeros: np.ndarray | None  # spec.param_dtypes[1]


def pack(qw: QuantizedWeight, spec: KernelSpec, factors=None) -> PackedWeight:
    """Lay ``qw`` out for ``spec``. Deterministic; numpy, vectorized over row slices of ~``PACK_WEIGHTS`` codes.
    ``factors``: ``factor_params(qw)`` where the caller has it."""
    m, k = qw.shape
    fmt = qw.format
    # float16 storage of plain parameters needs the format's promise; super scales are checked below
    halves_unpromised = not spec.super_groups and (
        (spec.scale_dtype == "float16" and fmt.scale_dtype != "float16") or
        (spec.has_zeros and spec.zero_dtype == "float16" and fmt.zero_dtype != "float16"))
    if (k, fmt.bits, fmt.has_zeros) != (spec.k, spec.bits, spec.has_zeros) or halves_unpromised or \
            (spec.triples and not (fmt.ternary and qw.scales.shape[1] == 1)):
        raise ValueError(f"weight (K={k}, bits={fmt.bits}, zeros={fmt.has_zeros}, parameters "
                         f"{fmt.scale_dtype}/{fmt.zero_dtype}) does not match kernel {spec.name}")
    bm, mb = spec.block_rows, spec.blocks(m)
    weights = np.empty(packed_shapes(spec, m)[0], dtype=np.uint8)
    chunks = chunk_views(weights, spec)
    step = max(1, PACK_WEIGHTS // (bm * k))  # blocks per slice
    for b0 in range(0, mb, step):
        b1 = min(mb, b0 + step)
        codes = np.full(((b1 - b0) * bm, k), 2 if spec.triples else 0, dtype=np.uint8)  # padded rows: weight 0
        rows = qw.codes[b0 * bm:b1 * bm]
        codes[:rows.shape[0]] = rows
        part = (_pack_quads if spec.quads else _pack_triples if spec.triples else _pack_blocks)(codes, spec)
        for r0, n, view in chunks:
            view[b0:b1] = part[:, r0:r0 + n]
    if spec.super_groups:
        if factors is None:
            factors = factor_params(qw, spec.super_groups)
        if factors is None:
            raise ValueError(f"the scales (and zeros) of this {fmt.name} weight are not multiples of one float32 per "
                             f"{spec.super_groups} groups, as kernel {spec.name} needs")
        if spec.scale_dtype == "float16" and super_dtype(factors) != "float16":
            raise ValueError(f"the super scales of this {fmt.name} weight are not all float16 values, as kernel "
                             f"{spec.name} stores them")
        (a, d), zero_factors = factors
        scales = _pack_super(a, d, qw, spec)
        zeros = None if zero_factors is None else _pack_super(*zero_factors, qw, spec)
    else:
        scales = _pack_params(qw.scales, qw, spec, spec.scale_dtype)
        zeros = None if qw.zeros is None else _pack_params(qw.zeros, qw, spec, spec.zero_dtype)
    return PackedWeight(spec, m, weights, chunk_major(scales, spec), None if zeros is None else chunk_major(zeros, spec))


def chunk_views(a: np.ndarray, spec: KernelSpec) -> list[tuple[int, int, np.ndarray]]:
    """``(r0, n, view)`` per K chunk of an array of ``a``'s shape ``[MB, R, X]`` (rows of each block spanning K:
    steps, weight or super groups) stored in K-chunk order: ``view [MB, n, X]`` holds rows ``r0 .. r0+n`` of every
    block, the chunks one after another (the shape stays)."""
    if a.shape[1] == 1:
        return [(0, 1, a)]
    flat, at, views = a.reshape(-1), 0, []
    for r0, n in spec.chunk_ranges(a.shape[1]):
        size = a.shape[0] * n * a.shape[2]
        views.append((r0, n, flat[at:at + size].reshape(a.shape[0], n, a.shape[2])))
        at += size
    return views


def chunk_major(a: np.ndarray, spec: KernelSpec) -> np.ndarray:
    """Block-major ``a [MB, R, X]`` in K-chunk order (``chunk_views``)."""
    out = np.empty_like(a)
    for r0, n, view in chunk_views(out, spec):
        view[...] = a[:, r0:r0 + n]
    return out


def block_major(a: np.ndarray, spec: KernelSpec) -> np.ndarray:
    """The inverse of ``chunk_major``."""
    out = np.empty_like(a)
    for r0, n, view in chunk_views(a, spec):
        out[:, r0:r0 + n] = view
    return out


def _pack_blocks(codes: np.ndarray, spec: KernelSpec) -> np.ndarray:
    """W for whole row blocks of codes ``[blocks·BM, K]``."""
    bm, vl, k = spec.block_rows, spec.vector_bytes, spec.k
    mb = codes.shape[0] // bm
    nib = plane_nibbles(codes, spec.bits)  # [bits, rows, K/4]
    pair = nib[:, :, 0::2] | (nib[:, :, 1::2] << 4)  # [bits, rows, K/8]: low nibble table 2kp, high 2kp+1
    pair = pair.reshape(spec.bits, mb, bm, k // 8)
    parts = []
    for first, planes in spec.chunks:
        per_vec = vl // planes
        # [planes, MB, BM, K/8] → [MB, K/8, vectors, rows-in-vector, planes]
        c = pair[first:first + planes].reshape(planes, mb, bm // per_vec, per_vec, k // 8)
        parts.append(c.transpose(1, 4, 2, 3, 0).reshape(mb, k // 8, bm * planes))
    return np.concatenate(parts, axis=2)


def _pack_triples(codes: np.ndarray, spec: KernelSpec) -> np.ndarray:
    """W of the triple layout for whole row blocks of ternary codes ``[blocks·BM, K]``."""
    bm, kp = spec.block_rows, spec.k_padded
    mb, steps = codes.shape[0] // bm, kp // 24
    idx, neg = triple_indices(codes, kp)  # [rows, Kp/3]
    pair = (idx[:, 0::2] | (idx[:, 1::2] << 4)).reshape(mb, bm, steps, 4).transpose(0, 2, 3, 1)
    vl = spec.vector_bytes
    # [MB, vectors, VL rows, steps, 8 triples] → [MB, steps, vectors, 8 masks, VL bits]
    flags = neg.reshape(mb, bm // vl, vl, steps, 8).transpose(0, 3, 1, 4, 2)
    masks = np.packbits(flags, axis=4, bitorder="little").reshape(mb, steps, bm)
    return np.concatenate([pair.reshape(mb, steps, 4 * bm), masks], axis=2)


def _unpack_triples(w: np.ndarray, spec: KernelSpec) -> np.ndarray:
    """Ternary codes ``[MB·BM, K]`` of W in the triple layout (the inverse of ``_pack_triples``)."""
    bm, mb, steps = spec.block_rows, w.shape[0], spec.k_padded // 24
    pair = w[:, :, :4 * bm].reshape(mb, steps, 4, bm).transpose(0, 3, 1, 2).reshape(mb * bm, steps * 4)
    idx = np.stack([pair & 15, pair >> 4], axis=2).reshape(mb * bm, steps * 8)
    vl = spec.vector_bytes
    masks = w[:, :, 4 * bm:].reshape(mb, steps, bm // vl, 8, vl // 8)
    flags = np.unpackbits(masks, axis=4, bitorder="little")  # [MB, steps, vectors, 8, VL]
    neg = flags.transpose(0, 2, 4, 1, 3).reshape(mb * bm, steps * 8).astype(bool)
    return _codes_of_triples(idx, neg, spec.k)


def _codes_of_triples(idx: np.ndarray, neg: np.ndarray, k: int) -> np.ndarray:
    """Ternary codes ``[rows, k]`` of triple indices and negation flags ``[rows, ≥ k/3]``."""
    e = np.where(neg, 26 - idx.astype(np.int16), idx).astype(np.uint8)  # 9·d0 + 3·d1 + d2, digits d = code − 1
    digits = np.stack([e // 9, e // 3 % 3, e % 3], axis=2).reshape(idx.shape[0], -1)
    return digits[:, :k] + 1


def _pack_quads(codes: np.ndarray, spec: KernelSpec) -> np.ndarray:
    """W of the quad layout for whole row blocks of codes ``[blocks·BM, K]`` (1-3 bits, or ternary triples)."""
    bm, vl, tables = spec.block_rows, spec.vector_bytes, spec.step_tables
    mb, nv = codes.shape[0] // bm, bm * 4 // vl
    if spec.triples:
        idx, neg = triple_indices(codes, spec.k_padded)
        nib = idx[None]
    else:
        nib, neg = plane_nibbles(codes, spec.bits), None
    steps = nib.shape[2] // tables
    nib = nib.reshape(nib.shape[0], mb, nv, vl // 4, steps, tables)
    parts = []
    for first, planes, t0 in spec.quad_chunks:
        # [P, MB, vectors, VL/4 rows, steps, low/high nibble, table] → [MB, steps, vectors, rows, low/high, table, P]
        c = nib[first:first + planes, ..., t0:t0 + 8 // planes]
        q = c.reshape(planes, mb, nv, vl // 4, steps, 2, 4 // planes).transpose(1, 4, 2, 3, 5, 6, 0)
        parts.append((q[..., 0, :, :] | (q[..., 1, :, :] << 4)).reshape(mb, steps, 4 * bm))
    if neg is not None:
        flags = neg.reshape(mb, nv, vl // 4, steps, 2, 4).transpose(0, 3, 1, 4, 2, 5).reshape(mb, steps, nv, 2, vl)
        parts.append(np.packbits(flags, axis=4, bitorder="little").reshape(mb, steps, bm))
    return np.concatenate(parts, axis=2)


def _unpack_quads(w: np.ndarray, spec: KernelSpec) -> np.ndarray:
    """Codes ``[MB·BM, K]`` of W in the quad layout (the inverse of ``_pack_quads``)."""
    bm, vl, tables, (mb, steps, _) = spec.block_rows, spec.vector_bytes, spec.step_tables, w.shape
    nv = bm * 4 // vl
    nib = np.empty((1 if spec.triples else spec.bits, mb, nv, vl // 4, steps, tables), dtype=np.uint8)
    for c, (first, planes, t0) in enumerate(spec.quad_chunks):
        q = w[:, :, 4 * bm * c:4 * bm * (c + 1)].reshape(mb, steps, nv, vl // 4, 1, 4 // planes, planes)
        q = np.concatenate([q & 15, q >> 4], axis=4)  # [MB, steps, vectors, rows, low/high, table, P]
        nib[first:first + planes, ..., t0:t0 + 8 // planes] = \
            q.transpose(6, 0, 2, 3, 1, 4, 5).reshape(planes, mb, nv, vl // 4, steps, 8 // planes)
    nib = nib.reshape(nib.shape[0], mb * bm, steps * tables)
    if not spec.triples:
        return _codes_of_nibbles(nib)
    masks = w[:, :, 4 * bm:].reshape(mb, steps, nv, 2, vl // 8)
    flags = np.unpackbits(masks, axis=4, bitorder="little").reshape(mb, steps, nv, 2, vl // 4, 4)
    neg = flags.transpose(0, 2, 4, 1, 3, 5).reshape(mb * bm, steps * 8).astype(bool)
    return _codes_of_triples(nib[0], neg, spec.k)


def unpack(packed: PackedWeight, fmt: WeightFormat) -> QuantizedWeight:
    """The exact inverse of ``pack``: codes and parameters of the ``packed.m`` true rows in format ``fmt``."""
    spec, m = packed.spec, packed.m
    if (fmt.bits, fmt.has_zeros) != (spec.bits, spec.has_zeros) or (spec.triples and not fmt.ternary):
        raise ValueError(f"format {fmt.name} does not match kernel {spec.name}")
    unpack_weights = _unpack_quads if spec.quads else _unpack_triples if spec.triples else _unpack_blocks
    codes = unpack_weights(block_major(packed.weights, spec), spec)
    s, z = (None if p is None else block_major(p, spec) for p in (packed.scales, packed.zeros))
    if spec.super_groups:  # scale d·a, zero m·b − offset·scale
        scales = _unpack_super(s, m, spec, fmt)
        zeros = None if z is None else _unpack_super(z, m, spec, fmt) - np.float32(fmt.offset) * scales
    else:
        scales = _unpack_params(s, m, fmt)
        zeros = None if z is None else _unpack_params(z, m, fmt)
    return QuantizedWeight(np.ascontiguousarray(codes[:m]), scales, zeros, fmt)


UNPACK_ROWS = 4096  # rows unpacked at a time: the temporaries are ~5x the codes (a tied 8-bit head's: 140 MB at once)


def _unpack_blocks(w: np.ndarray, spec: KernelSpec) -> np.ndarray:
    """Codes ``[MB·BM, K]`` of W in the bit-plane layout (the inverse of ``_pack_blocks``), a few blocks at a time."""
    bm, step = spec.block_rows, max(1, UNPACK_ROWS // spec.block_rows)
    codes = np.empty((w.shape[0] * bm, spec.k), dtype=np.uint8)
    for b in range(0, w.shape[0], step):
        codes[b * bm:(b + step) * bm] = _unpack_block_rows(w[b:b + step], spec)
    return codes


def _unpack_block_rows(w: np.ndarray, spec: KernelSpec) -> np.ndarray:
    bm, vl, mb, k = spec.block_rows, spec.vector_bytes, w.shape[0], spec.k
    pair = np.empty((spec.bits, mb, bm, k // 8), dtype=np.uint8)
    start = 0
    for first, planes in spec.chunks:
        per_vec = vl // planes
        c = w[:, :, start:start + bm * planes].reshape(mb, k // 8, bm // per_vec, per_vec, planes)
        pair[first:first + planes] = c.transpose(4, 0, 2, 3, 1).reshape(planes, mb, bm, k // 8)
        start += bm * planes
    nib = np.empty((spec.bits, mb * bm, k // 4), dtype=np.uint8)
    nib[:, :, 0::2] = pair.reshape(spec.bits, mb * bm, k // 8) & 15
    nib[:, :, 1::2] = pair.reshape(spec.bits, mb * bm, k // 8) >> 4
    return _codes_of_nibbles(nib)


def _codes_of_nibbles(nib: np.ndarray) -> np.ndarray:
    """Codes ``[rows, 4·T]`` of plane nibbles ``[bits, rows, T]`` (the inverse of ``plane_nibbles``)."""
    bits, rows, t = nib.shape
    codes = np.zeros((rows, 4 * t), dtype=np.uint8)
    for plane in range(bits):
        for j in range(4):
            codes[:, j::4] |= ((nib[plane] >> j) & 1) << plane
    return codes


def _unpack_params(p: np.ndarray, m: int, fmt: WeightFormat) -> np.ndarray:
    rows = p.transpose(0, 2, 1).reshape(-1, p.shape[1])[:m].astype(np.float32)  # [M, K/WG]
    return np.ascontiguousarray(rows[:1, :1] if fmt.group_size == PER_TENSOR else rows)


def _pack_super(mult: np.ndarray, base: np.ndarray, qw: QuantizedWeight, spec: KernelSpec) -> np.ndarray:
    """S or Z of a super-scale spec: per super group, its groups' multipliers ``[SG, BM]``, then its super scales'
    bytes — one sequential stream, as the kernels read them."""
    bm, mb, sg = spec.block_rows, spec.blocks(qw.shape[0]), spec.super_groups
    head = _pack_params(mult, qw, spec, mult.dtype)  # [MB, G, BM]
    g = head.shape[1]
    full = np.zeros((mb * bm, g // sg), spec.scale_dtype)
    full[:qw.shape[0]] = base
    tail = np.ascontiguousarray(full.reshape(mb, bm, -1).transpose(0, 2, 1)).view(mult.dtype)  # [MB, G/SG, F·BM]
    return np.concatenate([head.reshape(mb, g // sg, sg * bm), tail], axis=2)


def _unpack_super(p: np.ndarray, m: int, spec: KernelSpec, fmt: WeightFormat) -> np.ndarray:
    """Float32 ``[M, G]`` base × multiplier of S or Z of a super-scale spec (d·a, or m·b)."""
    bm, sg = spec.block_rows, spec.super_groups
    mb, supers = p.shape[:2]
    mult = _unpack_params(np.ascontiguousarray(p[:, :, :sg * bm]).reshape(mb, supers * sg, bm), m, fmt)
    tail = np.ascontiguousarray(p[:, :, sg * bm:]).view(spec.scale_dtype)  # [MB, G/SG, BM]
    return np.repeat(_unpack_params(tail, m, fmt), sg, axis=1) * mult


def _pack_params(p: np.ndarray, qw: QuantizedWeight, spec: KernelSpec, dtype: str) -> np.ndarray:
    m, k = qw.shape
    per_row = np.broadcast_to(p, (m, p.shape[1])) if p.shape[0] == 1 else p  # per-tensor → every row
    g = k // spec.group_size
    full = np.zeros((spec.blocks(m) * spec.block_rows, g), dtype=dtype)
    full[:m] = np.repeat(per_row, g // per_row.shape[1], axis=1) if per_row.shape[1] != g else per_row
    return np.ascontiguousarray(full.reshape(spec.blocks(m), spec.block_rows, g).transpose(0, 2, 1))
