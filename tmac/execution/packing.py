"""Packing a ``QuantizedWeight`` for a ``KernelSpec``: its codes in the spec's layout (``tmac.quant.layout``: bit planes,
triples or quads, each describing its own bytes), its scales and zeros, and the order of K chunks; and the exact
inverse. The byte layout of S, Z and K chunks is described here and only here.

    S, Z [MB, K/WG, BM]  float16 or float32, as the spec says (scale, zero of row ``blk·BM + r`` for weight
                         group g; per-row: WG = K; triples: ``[MB, 1, BM]``)

With ``super_groups`` = SG > 0 (formats with a ``super_group``: llama.cpp's K-quants), scales and zeros are
integer multiples of one *super scale* per SG groups of a row, and S and Z hold those, a super group at a time:

    S, Z [MB, K/(WG·SG), (SG + F)·BM]  uint8 (S of a format without zeros: int8)

Byte ``[blk, j, i·BM + r]`` (i < SG) is the multiplier a (of S) or b (of Z) of row r's group ``j·SG + i``; bytes
``SG·BM ..`` of ``[blk, j]`` are the super scales ``[BM]`` in the spec's ``scale_dtype`` (F bytes each: float16,
as llama.cpp stores d and dmin, where every one is a float16 value, else float32): d (of S) or m (of Z) of super
group j of each row. The scale is d·a and the zero m·b − offset·d·a, both exact in float32; without zeros (Q3_K,
Q6_K) a is signed.

Tables are ``LUT [N', K'/A, 16]`` int8 (A activations a table: 4, or 3 for triples), their scales ``LS [N', K'/LG]``
and activation sums ``XS [N', K/WG]`` float32, with N' = N rounded up to the kernel's row tile (``XS`` is unused
where the codes are symmetric: triples).

*K chunks* (``k_chunk``: a whole number of lut groups, and of weight or super groups where a row has several):
the kernels take K a chunk at a time across all blocks, so that the chunk's tables stay in L1 while the blocks
stream. W, and S and Z where they span K, keep the shapes above, but their ``[MB, R, X]`` rows (R: steps, groups or
super groups) are stored chunk by chunk: chunk c of rows ``[r0, r0 + n)`` (the last chunk may be shorter) is an
``[MB, n, X]`` array after the chunks before it, so row r of block b is flat row ``MB·r0 + b·n + (r − r0)``. With
one chunk (``k_chunk`` = Kp, the default on 32-byte vectors and on 64-byte ones but for triples and W1) that is
the plain ``[MB, R, X]`` order.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from tmac.quant.choose import spec_and_factors, super_dtype
from tmac.quant.held import held_format, held_weight, imported_weight
from tmac.base.formats import PER_TENSOR, WeightFormat
from tmac.quant.kquant import factor_params
from tmac.quant.layout import SHIFT_MULTIPLIER
from tmac.base.memory import packed_empty
from tmac.base.qweight import QuantizedWeight, RowCodes
from tmac.quant.spec import KernelSpec, packed_shapes

PACK_WEIGHTS = 1 << 19  # codes packed at a time: the layout's temporaries, ~15 bytes a code, stay ~8 MiB


def pack_for(qw: QuantizedWeight, isa, **tiling) -> PackedWeight:
    """``pack(qw, spec_for(qw, isa, **tiling))``, factoring K-quant parameters once, not twice."""
    spec, factors = spec_and_factors(qw, isa, tiling)
    return pack(qw, spec, factors)


@dataclass(frozen=True)
class PackedWeight:
    """Weights in a kernel's layout. ``m`` is the true row count (W, S, Z are padded to whole blocks)."""

    spec: KernelSpec
    m: int
    weights: np.ndarray  # uint8 [MB, steps, step bytes·BM] (spec.layout)
    scales: np.ndarray  # spec.param_dtypes[0] [MB, K/WG, BM] (super scales: [MB, K/(WG·SG), (SG + F)·BM])
    zeros: np.ndarray | None  # spec.param_dtypes[1]


def pack(qw: QuantizedWeight, spec: KernelSpec, factors=None) -> PackedWeight:
    """Lay ``qw`` out for ``spec``. Deterministic; numpy, vectorized over row slices of ~``PACK_WEIGHTS`` codes.
    ``factors``: ``factor_params(qw)`` where the caller has it."""
    qw, factors = held_weight(qw, spec, factors)  # (IQ1_S's grid: codebook codes)
    m, k = qw.shape
    fmt, layout = qw.format, spec.layout
    # float16 storage of plain parameters needs the format's promise; super scales are checked below
    halves_unpromised = not spec.super_groups and (
        (spec.scale_dtype == "float16" and fmt.scale_dtype != "float16") or
        (spec.has_zeros and spec.zero_dtype == "float16" and fmt.zero_dtype != "float16"))
    if (k, fmt.bits, fmt.has_zeros) != (spec.k, spec.bits, spec.has_zeros) or halves_unpromised or \
            not layout.accepts(fmt, qw.scales.shape[1]):
        raise ValueError(f"weight (K={k}, bits={fmt.bits}, zeros={fmt.has_zeros}, parameters "
                         f"{fmt.scale_dtype}/{fmt.zero_dtype}) does not match kernel {spec.name}")
    bm, mb = spec.block_rows, spec.blocks(m)
    weights = packed_empty(packed_shapes(spec, m)[0])
    chunks = chunk_views(weights, spec)
    step = max(1, PACK_WEIGHTS // (bm * k))  # blocks per slice
    shifts = layout.shifts  # (IQ1's grid: its shifts go into the multipliers)
    shift_bits = np.zeros((mb * bm, k // spec.group_size), np.uint8) if shifts else None
    for b0 in range(0, mb, step):
        b1 = min(mb, b0 + step)
        codes = np.full(((b1 - b0) * bm, k), layout.codes.pad_code, dtype=np.uint8)
        rows = qw.codes[b0 * bm:b1 * bm]
        codes[:rows.shape[0]] = rows
        part = layout.pack(codes, spec)
        for r0, n, view in chunks:
            view[b0:b1] = part[:, r0:r0 + n]
        if shifts:
            shift_bits[b0 * bm:b1 * bm] = layout.shift_bits(codes, spec.group_size)
    if spec.super_groups:
        if factors is None:
            factors = factor_params(qw, spec.super_groups)
        if factors is None:
            raise ValueError(f"the scales (and zeros) of this {fmt.name} weight are not multiples of one float32 per "
                             f"{spec.super_groups} groups, as kernel {spec.name} needs")
        if spec.scale_dtype == "float16" and super_dtype(factors, spec.super_exponent) != "float16":
            raise ValueError(f"the super scales of this {fmt.name} weight are not all float16 values, as kernel "
                             f"{spec.name} stores them")
        (a, d), zero_factors = factors
        if shifts:
            if (np.asarray(a) & ~np.int64(SHIFT_MULTIPLIER)).any():
                raise ValueError(f"multipliers of this {fmt.name} weight exceed {SHIFT_MULTIPLIER}, which kernel "
                                 f"{spec.name} holds below its grid entries' shifts")
            a = (np.asarray(a) | shift_bits[:m]).astype(a.dtype)
        scales = _pack_super(a, d, qw, spec)
        zeros = None if zero_factors is None else _pack_super(*zero_factors, qw, spec)
    else:
        scales = _pack_params(qw.scales, qw, spec, spec.scale_dtype)
        zeros = None if qw.zeros is None else _pack_params(qw.zeros, qw, spec, spec.zero_dtype)
    return PackedWeight(spec, m, weights, chunk_major(scales, spec), None if zeros is None else chunk_major(zeros, spec))


def layout_checksum(spec: KernelSpec, *arrays) -> int:
    """CRC-32 of a spec and the packed arrays laid out as it says (None: absent): a saved layer whose spec (a K chunk,
    a tiling) was changed without repacking would otherwise load silently and compute garbage."""
    crc = zlib.crc32(spec.to_json().encode())
    for a in arrays:
        if a is not None:
            crc = zlib.crc32(np.ascontiguousarray(a).view(np.uint8), crc)
    return crc


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
    """Block-major ``a [MB, R, X]`` in K-chunk order (``chunk_views``), where packed weights are made
    (``packed_empty``)."""
    out = packed_empty(a.shape, a.dtype)
    for r0, n, view in chunk_views(out, spec):
        view[...] = a[:, r0:r0 + n]
    return out


def block_major(a: np.ndarray, spec: KernelSpec) -> np.ndarray:
    """The inverse of ``chunk_major``."""
    out = np.empty_like(a)
    for r0, n, view in chunk_views(a, spec):
        out[:, r0:r0 + n] = view
    return out


def unpack(packed: PackedWeight, fmt: WeightFormat) -> QuantizedWeight:
    """The exact inverse of ``pack``: codes and parameters of the ``packed.m`` true rows in format ``fmt``."""
    held = held_format(fmt, None, packed.spec.grid)
    if held is not fmt:
        return imported_weight(unpack(packed, held), fmt)
    spec = _check_unpack(packed, fmt)
    codes = spec.layout.unpack(block_major(packed.weights, spec), spec)[:packed.m]
    if spec.layout.shifts:
        stored = _super_factors(block_major(packed.scales, spec), packed.m, spec)[0]  # (the shifts in place)
        codes = spec.layout.with_shifts(codes, stored, spec.group_size)
    scales, zeros, factors = _params_and_factors(packed, fmt)
    return QuantizedWeight(np.ascontiguousarray(codes), scales, zeros, fmt, factors)


def unpack_by_rows(packed: PackedWeight, fmt: WeightFormat) -> QuantizedWeight:
    """``unpack(packed, fmt)`` whose codes are ``RowCodes``: unpacked a few blocks at a time as row slices are read
    (a 49152-row head's codes unpacked whole took twice their size for a moment)."""
    held = held_format(fmt, None, packed.spec.grid)
    if held is not fmt:
        return imported_weight(unpack_by_rows(packed, held), fmt)
    _check_unpack(packed, fmt)
    bm = packed.spec.block_rows

    def rows(r0: int, r1: int) -> np.ndarray:
        b0 = r0 // bm
        part = unpack(blocks_of(packed, b0, -(-r1 // bm)), fmt)
        return part.codes[r0 - b0 * bm:r1 - b0 * bm]

    scales, zeros, factors = _params_and_factors(packed, fmt)
    return QuantizedWeight(RowCodes((packed.m, packed.spec.k), rows), scales, zeros, fmt, factors)


def blocks_of(packed: PackedWeight, b0: int, b1: int) -> PackedWeight:
    """Row blocks ``b0 .. b1`` of ``packed`` as packed weights of their own (their true rows; K-chunk order kept)."""
    spec, bm = packed.spec, packed.spec.block_rows

    def part(a: np.ndarray | None) -> np.ndarray | None:
        if a is None:
            return None
        views = [v[b0:b1].reshape(-1) for _, _, v in chunk_views(a, spec)]
        return np.concatenate(views).reshape(b1 - b0, *a.shape[1:])

    return PackedWeight(spec, min(packed.m, b1 * bm) - b0 * bm, part(packed.weights), part(packed.scales),
                        part(packed.zeros))


def _params_and_factors(packed: PackedWeight, fmt: WeightFormat):
    """Float32 scales and zeros (None without) of the ``packed.m`` true rows in format ``fmt``, and the multipliers
    and super scales of a super-scale spec as ``QuantizedWeight.factors`` holds them (a repack for another ISA takes
    them as they are), or None: plain parameters, or super groups other than the format's."""
    spec, m = packed.spec, packed.m
    s, z = (None if p is None else block_major(p, spec) for p in (packed.scales, packed.zeros))
    if not spec.super_groups:
        return _unpack_params(s, m, fmt), None if z is None else _unpack_params(z, m, fmt), None
    shifts = spec.layout.shifts
    factors = (_super_factors(s, m, spec, shifts), None if z is None else _super_factors(z, m, spec))
    (a, d), zero = factors  # scale d·a, zero m·b − offset·scale
    scales = np.repeat(d, spec.super_groups, axis=1) * a.astype(np.float32)
    zeros = None if zero is None else \
        np.repeat(zero[1], spec.super_groups, axis=1) * zero[0].astype(np.float32) - np.float32(fmt.offset) * scales
    return scales, zeros, factors if spec.super_groups == fmt.groups_per_super else None


def _check_unpack(packed: PackedWeight, fmt: WeightFormat) -> KernelSpec:
    spec = packed.spec
    if (fmt.bits, fmt.has_zeros) != (spec.bits, spec.has_zeros) or not spec.layout.accepts(fmt):
        raise ValueError(f"format {fmt.name} does not match kernel {spec.name}")
    return spec


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
    full[:qw.shape[0]] = np.ldexp(base, spec.super_exponent)  # (exact: a power of two)
    tail = np.ascontiguousarray(full.reshape(mb, bm, -1).transpose(0, 2, 1)).view(mult.dtype)  # [MB, G/SG, F·BM]
    return np.concatenate([head.reshape(mb, g // sg, sg * bm), tail], axis=2)


def _super_factors(p: np.ndarray, m: int, spec: KernelSpec, shifts: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The multipliers ``[M, G]`` (their packed bytes' type) and float32 super scales ``[M, G/SG]`` of S or Z of a
    super-scale spec (block-major); ``shifts``: the multipliers without the grid entries' shifts above them."""
    bm, sg = spec.block_rows, spec.super_groups
    mb, supers = p.shape[:2]
    rows = lambda a: np.ascontiguousarray(a.transpose(0, 2, 1).reshape(-1, a.shape[1])[:m])  # noqa: E731 [M, X]
    mult = rows(np.ascontiguousarray(p[:, :, :sg * bm]).reshape(mb, supers * sg, bm))
    if shifts:  # (IQ1's grid: ``pack``)
        mult = mult & mult.dtype.type(SHIFT_MULTIPLIER)
    tail = np.ascontiguousarray(p[:, :, sg * bm:]).view(spec.scale_dtype)  # [MB, G/SG, BM]
    return mult, np.ldexp(rows(tail).astype(np.float32), -spec.super_exponent)


def _pack_params(p: np.ndarray, qw: QuantizedWeight, spec: KernelSpec, dtype: str) -> np.ndarray:
    m, k = qw.shape
    per_row = np.broadcast_to(p, (m, p.shape[1])) if p.shape[0] == 1 else p  # per-tensor → every row
    g = k // spec.group_size
    full = np.zeros((spec.blocks(m) * spec.block_rows, g), dtype=dtype)
    full[:m] = np.repeat(per_row, g // per_row.shape[1], axis=1) if per_row.shape[1] != g else per_row
    return np.ascontiguousarray(full.reshape(spec.blocks(m), spec.block_rows, g).transpose(0, 2, 1))
