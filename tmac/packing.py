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

import json
import warnings
from dataclasses import asdict, dataclass, fields

import numpy as np

from .formats import K_MULTIPLE, PARAM_DTYPES, PER_ROW, PER_TENSOR, WeightFormat, check_bits
from .qweight import QuantizedWeight, all_float16
from .reference import LUT_GROUPS, TRIPLE_LUT_GROUP, default_lut_group, padded_k, plane_nibbles, triple_indices

TRIPLES_LAYOUT = 2  # of the packed triple bytes (2: flags as bit masks), stored with saved weights
CHUNK_BYTES = 16 << 10  # a K chunk's tables + one block's weights of it: half of a 32 KiB L1 (see _default_k_chunk)
PACK_WEIGHTS = 1 << 21  # codes packed at a time: the layout's temporaries, ~15 bytes a code, stay ~30 MiB
CHUNKS = {1: ((0, 1),), 2: ((0, 2),), 3: ((0, 2), (2, 1)), 4: ((0, 4),), 5: ((0, 4), (4, 1)), 6: ((0, 4), (4, 2)),
          8: ((0, 4), (4, 4))}  # bits → ((first plane, planes), ...)
QUAD_CHUNKS = {1: ((0, 1, 0),), 2: ((0, 2, 0),), 3: ((0, 2, 0), (0, 2, 4), (2, 1, 0)),
               5: ((0, 2, 0), (0, 2, 4), (2, 2, 0), (2, 2, 4), (4, 1, 0))}  # bits → ((plane, P, table), ...)


def quad_step(bits: int) -> int:
    """Activations a quad step of ``bits``-bit weights covers (4 per table; a chunk of P planes covers 8/P tables
    from its first): 16 at 2 bits, else 32."""
    return 4 * max(t0 + 8 // planes for _, planes, t0 in QUAD_CHUNKS[bits])


@dataclass(frozen=True)
class KernelSpec:
    """Everything a compiled LUT kernel is specialized on. M and N are runtime sizes, not part of it."""

    isa: str
    vector_bytes: int
    bits: int
    k: int
    group_size: int  # activations per weight scale (K for per-row and per-tensor weights)
    lut_group: int  # activations per table scale; divides group_size
    has_zeros: bool
    block_rows: int = 0  # 0: the default for this ISA and bit width
    # activation rows sharing each weight load in the GEMM kernel; 0: the default, 2 (at 4 a tile's accumulators and
    # tables outgrow 32 vector registers), but 4 for W1 on 32-byte vectors (docs/decisions.md, "GEMM row tile")
    n_tile: int = 0
    unroll: int = 0  # table pairs unrolled in the inner loop; 0: the default (the most of 8, 4, 2, 1 that fits)
    scale_dtype: str = "float32"  # storage of S and Z: the format's (tmac.formats.PARAM_DTYPES); super scales'
    zero_dtype: str = "float32"  # with super_groups (one dtype for both)
    triples: bool = False  # ternary weights three to an index + sign (1.67 bits), instead of 2 bit planes
    quads: bool = False  # a row's 4 bytes look into four tables at once (64-entry lookups): 1-3, 5 bits, triples
    super_groups: int = 0  # weight groups sharing one super scale of the scales and zeros (K-quants); 0: plain S, Z
    k_chunk: int = 0  # activations per K chunk (see the module doc); 0: the default for the tables' L1 budget

    def __post_init__(self):
        check_bits(self.bits)
        sixteen_registers = self.vector_bytes == 32  # AVX2 (AVX-512 and NEON have 32)
        if self.block_rows == 0:
            # blocks of 4 weight vectors a step (W4, 1- and 2-bit quads) and 5-bit quads on 64-byte vectors take
            # twice the rows (docs/decisions.md, "Block rows")
            rows = default_block_rows(self.vector_bytes, self.row_bytes)
            wider = 2 if self.vector_bytes == 64 and self.row_bytes == 4 and not self.triples and \
                (self.step_vectors(rows) == 4 or self.quads and self.bits == 5) else 1
            # AVX2's 16 registers: a one-plane vector's sums (W1; triples, where asked for without quads) are int16
            # of 32 rows, two registers, so such blocks take half the rows (4 vectors spilled)
            narrower = 2 if sixteen_registers and self.chunks == ((0, 1),) else 1
            object.__setattr__(self, "block_rows", wider * rows // narrower)
        if self.n_tile == 0:
            # AVX2's W1 GEMM splits a tile's block into parts of one accumulator vector a row (gemm_accumulators), so
            # a part's weight vector serves 4 activation rows where 2 left it half used
            object.__setattr__(self, "n_tile", 4 if sixteen_registers and self.bits == 1 else 2)
        steps = self.steps_per_lut_group
        if self.unroll == 0 and steps:
            # up to 8 table pairs and 32 weight vectors per unrolled body; on 32-byte vectors (AVX2: 16 registers) a
            # lut group of 4 or more steps is not unrolled whole: the body and the epilogue would share one basic
            # block, whose schedule spills (docs/decisions.md, "Unroll")
            vectors = self.step_vectors(self.block_rows)
            fits = [u for u in self.unrolls() if u * vectors <= 32
                    and not (sixteen_registers and u == steps and steps >= 4)]
            object.__setattr__(self, "unroll", fits[0] if fits else 1)
        if self.k_chunk == 0 and steps:
            object.__setattr__(self, "k_chunk", self._default_k_chunk())
        k, g, lg, bm, vl = self.k, self.group_size, self.lut_group, self.block_rows, self.vector_bytes
        problems = []
        if k <= 0 or k % K_MULTIPLE:
            problems.append(f"K={k} must be a positive multiple of {K_MULTIPLE}")
        if g <= 0 or k % g:
            problems.append(f"group_size={g} does not divide K={k}")
        if self.triples:
            if (self.bits, self.has_zeros, g, lg) != (2, False, k, TRIPLE_LUT_GROUP):
                problems.append(f"triples need 2-bit codes without zeros, one scale per row (group_size = K) and "
                                f"lut_group {TRIPLE_LUT_GROUP}")
        elif lg not in LUT_GROUPS or k % lg or g % lg:
            problems.append(f"lut_group={lg} must be one of {LUT_GROUPS} and divide K={k} and the group size {g}")
        if self.quads and (vl != 64 or not (self.triples or self.bits in QUAD_CHUNKS)):
            problems.append(f"quads need {sorted(QUAD_CHUNKS)}-bit weights or triples and 64-byte vectors")
        if vl not in (16, 32, 64):
            problems.append(f"vector_bytes={vl} must be 16, 32 or 64")
        elif bm <= 0 or bm % vl:
            problems.append(f"block_rows={bm} must be a positive multiple of the vector width {vl}")
        if self.n_tile < 1 or self.unroll < 1 or not steps or steps % self.unroll:
            problems.append(f"n_tile={self.n_tile}, unroll={self.unroll}: unroll must divide the "
                            f"{steps} steps of a lut group")
        if self.super_groups and (self.super_groups < 2 or self.super_groups % 2 or self.triples or lg != g or
                                  k % (g * self.super_groups)):
            problems.append(f"super_groups={self.super_groups} needs lut_group = group_size, an even count and must "
                            f"divide the K/group_size={k // g if g > 0 else '?'} groups")
        if self.super_groups and self.has_zeros and self.scale_dtype != self.zero_dtype:
            problems.append(f"super scales take one dtype, got {self.scale_dtype!r}/{self.zero_dtype!r}")
        if steps and (self.k_chunk <= 0 or self.k_chunk % self.chunk_unit or self.k_chunk > self.k_padded):
            problems.append(f"k_chunk={self.k_chunk} must be a positive multiple of {self.chunk_unit} up to "
                            f"{self.k_padded}")
        if self.scale_dtype not in PARAM_DTYPES or self.zero_dtype not in PARAM_DTYPES:
            problems.append(f"scale/zero dtypes must be in {PARAM_DTYPES}, got {self.scale_dtype!r}/{self.zero_dtype!r}")
        if problems:
            raise ValueError("invalid kernel spec: " + "; ".join(problems))
        # specs key the kernel and workspace caches on every call: hash the fields once
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self))))

    def __hash__(self) -> int:
        return self._hash

    @property
    def chunk_unit(self) -> int:
        """Activations a K chunk is a whole number of: lut groups, and weight groups or super groups when a row
        has several."""
        if self.super_groups:
            return self.group_size * self.super_groups
        return self.group_size if self.group_size < self.k else self.lut_group

    def _default_k_chunk(self) -> int:
        """Triples, 1-bit weights and 16-byte vectors: the most activations whose tables and one block's
        weights of them fit ``CHUNK_BYTES``, in chunks of near-equal size: streaming a block's weights through L1
        evicted its tables before the next block reused them. On 64-byte vectors 2-5 bits (fewer table bytes per
        weight byte) gain nothing: one chunk; so does AVX2, whose GEMV prefetches its weights (docs/decisions.md,
        "K chunks")."""
        unit, kp = self.chunk_unit, self.k_padded
        chunked = self.vector_bytes == 16 or self.vector_bytes == 64 and (self.triples or self.bits == 1)
        if not chunked or unit <= 0 or kp % unit:
            return kp  # (invalid specs: the checks that follow say why)
        w_shape, s_shape = packed_shapes(self, self.block_rows)
        per_activation = (np.prod(w_shape) + 2 * np.prod(s_shape)) / kp + (16 / 3 if self.triples else 4)
        units = kp // unit
        fit = max(1, min(units, int(CHUNK_BYTES // (per_activation * unit))))
        chunks = -(-units // fit)
        return -(-units // chunks) * unit

    def chunk_ranges(self, rows: int) -> list[tuple[int, int]]:
        """(first, count) of each K chunk in ``rows`` per-block rows spanning K (steps, weight or super groups)."""
        per = rows * self.k_chunk // self.k_padded
        return [(r, min(per, rows - r)) for r in range(0, rows, per)]

    @property
    def param_dtypes(self) -> tuple[str, str]:
        """Storage dtypes of S and Z: bytes of multipliers and super scales (scale multipliers signed without
        zeros), or the format's floats."""
        if self.super_groups:
            return ("uint8" if self.has_zeros else "int8"), "uint8"
        return self.scale_dtype, self.zero_dtype

    @property
    def super_bytes(self) -> int:
        """Bytes of one row's super scale in S and Z (``super_groups``)."""
        return np.dtype(self.scale_dtype).itemsize

    @property
    def quad_chunks(self) -> tuple[tuple[int, int, int], ...]:
        """Quads: (first plane, planes P, first table) of each quad chunk of a step, in their byte order."""
        return QUAD_CHUNKS[1 if self.triples else self.bits]

    def step_vectors(self, block_rows: int) -> int:
        """Weight vectors a block of ``block_rows`` rows reads per step (quads: one per quad chunk)."""
        return block_rows * self.row_bytes // self.vector_bytes * (len(self.quad_chunks) if self.quads else 1)

    @property
    def step_tables(self) -> int:
        """Quads: tables a step covers."""
        return quad_step(1 if self.triples else self.bits) // 4

    @property
    def chunks(self) -> tuple[tuple[int, int], ...]:
        """(first plane, bytes a row owns in a vector) of each run of planes (quads: 4 bytes of 4/P tables)."""
        if self.quads:
            return ((0, 4),)
        return ((0, 1),) if self.triples else CHUNKS[self.bits]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row in the weight vectors of one table pair (all chunks)."""
        return sum(planes for _, planes in self.chunks)

    @property
    def steps_per_lut_group(self) -> int:
        """Inner-loop steps per lut group: table pairs (8 activations), triple steps (24) or quad steps (32 at
        1 bit, 16 at 2 bits); 0 if invalid."""
        per = 24 if self.triples else 4 * self.step_tables if self.quads else 8
        return self.lut_group // per if self.lut_group > 0 and self.lut_group % per == 0 else 0

    def unrolls(self) -> list[int]:
        """Unroll factors worth trying, largest first: at most 8 table pairs per unrolled body (a triple step is
        4, a quad step 4 at 1 bit and 2 at 2 bits)."""
        pairs = 4 if self.triples else self.step_tables // 2 if self.quads else 1
        return [u for u in (8, 4, 2, 1) if u * pairs <= 8 and self.steps_per_lut_group % u == 0]

    @property
    def k_padded(self) -> int:
        """Activations the tables cover: K, or K rounded up to whole lut groups for triples."""
        return padded_k(self.k) if self.triples else self.k

    def table_shapes(self, rows: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """Shapes of LUT (int8), LS and XS (float32) for ``rows`` activation rows."""
        kp = self.k_padded
        return (rows, kp // 3 if self.triples else kp // 4, 16), (rows, kp // self.lut_group), \
            (rows, self.k // self.group_size)

    @property
    def name(self) -> str:
        z = "z" if self.has_zeros else "s"
        half = ("_sh" if self.scale_dtype == "float16" else "") + \
            ("_zh" if self.has_zeros and self.zero_dtype == "float16" else "") + ("_t3" if self.triples else "") + \
            ("_q4" if self.quads else "") + (f"_ks{self.super_groups}" if self.super_groups else "") + \
            (f"_kc{self.k_chunk}" if self.k_chunk < self.k_padded else "")
        return (f"lut_{self.isa}_b{self.bits}_k{self.k}_g{self.group_size}_lg{self.lut_group}{z}"
                f"_bm{self.block_rows}_nt{self.n_tile}_u{self.unroll}{half}")

    functions = ("build_tables", "lut_gemv", "lut_gemm")  # what its library exports (a class attribute)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, d) -> "KernelSpec":
        """A spec from JSON; specs written before the later fields existed lack them (float32, bit planes)."""
        names = {f.name for f in fields(cls)}
        strings = {"isa", "scale_dtype", "zero_dtype"}
        if isinstance(d, dict) and set(d) < names and names - set(d) <= set(_LATER_FIELDS):
            d = {**{f: _LATER_FIELDS[f] for f in names - set(d)}, **d}
            if d["k_chunk"] is None:  # written before K chunks: one chunk of all of K
                k = d.get("k")
                d["k_chunk"] = (padded_k(k) if d.get("triples") is True else k) if type(k) is int and k > 0 else 0
        if not isinstance(d, dict) or set(d) != names:
            raise ValueError(f"a kernel spec needs exactly the fields {sorted(names)}, got {d!r:.200}")
        for name in names - strings:
            if type(d[name]) is not (bool if name in ("has_zeros", "triples", "quads") else int):
                raise ValueError(f"kernel spec field {name!r} has the wrong type: {d[name]!r:.50}")
        for name in strings:
            if not isinstance(d[name], str):
                raise ValueError(f"kernel spec field {name!r} must be a string, got {d[name]!r:.50}")
        try:
            return cls(**d)
        except (KeyError, IndexError, ZeroDivisionError, OverflowError, TypeError) as e:  # a combination no
            raise ValueError(f"invalid kernel spec {d!r:.200} ({type(e).__name__}: {e})") from None  # check foresaw

    def blocks(self, m: int) -> int:
        return -(-m // self.block_rows)

    def padded_rows(self, n: int) -> int:
        return -(-n // self.n_tile) * self.n_tile


_LATER_FIELDS = {"scale_dtype": "float32", "zero_dtype": "float32", "triples": False, "quads": False,
                 "super_groups": 0, "k_chunk": None}  # old meaning (k_chunk: all of K)


def default_block_rows(vector_bytes: int, row_bytes: int) -> int:
    """About four vectors of weights per block: enough independent accumulator chains to hide latency."""
    return vector_bytes * max(1, 4 // row_bytes)


def spec_for(qw: QuantizedWeight, isa, **tiling) -> KernelSpec:
    """The kernel spec that serves ``qw`` on ``isa`` (a ``tmac.kernels.Isa``): with super scales where its format
    has them and its parameters factor (else plain float32 ones)."""
    return _spec_and_factors(qw, isa, tiling)[0]


def pack_for(qw: QuantizedWeight, isa, **tiling) -> PackedWeight:
    """``pack(qw, spec_for(qw, isa, **tiling))``, factoring K-quant parameters once, not twice."""
    spec, factors = _spec_and_factors(qw, isa, tiling)
    return pack(qw, spec, factors)


def _spec_and_factors(qw: QuantizedWeight, isa, tiling: dict):
    """The spec for ``qw``, and the factors of its parameters where that spec streams them (else None)."""
    fmt = qw.format
    if fmt.super_group is None or tiling.get("super_groups") == 0:
        return spec_for_format(fmt, qw.shape[1], isa, **tiling), None
    factors = factor_params(qw, tiling.get("super_groups"))
    if factors is None:  # plain float32 parameters
        tiling = {**tiling, "super_groups": 0}
    elif "super_dtype" not in tiling:
        tiling = {**tiling, "super_dtype": super_dtype(factors)}
    return spec_for_format(fmt, qw.shape[1], isa, **tiling), factors


def super_dtype(factors) -> str:
    """Storage of the super scales of ``factor_params``' factors: float16 where every one is a float16 value (a
    K-quant import's always are: llama.cpp's d and dmin), else float32."""
    bases = [f[1] for f in factors if f is not None]
    return "float16" if all(all_float16(b) for b in bases) else "float32"


def spec_for_format(fmt: WeightFormat, k: int, isa, **tiling) -> KernelSpec:
    """The kernel spec for weights of format ``fmt`` with ``k`` inputs on ``isa``; tiling not given explicitly
    comes from ``tmac tune``'s results for these parameters, else the defaults."""
    from .tuning import tuned_tiling

    group = k if fmt.group_size in (PER_ROW, PER_TENSOR) else fmt.group_size
    params = dict(scale_dtype=fmt.scale_dtype, zero_dtype=fmt.zero_dtype if fmt.has_zeros else "float32")
    supers = tiling.pop("super_groups", fmt.groups_per_super)
    halves = tiling.pop("super_dtype", "float16")  # (a K-quant file's own)
    if supers:
        params.update(super_groups=supers, scale_dtype=halves, zero_dtype=halves if fmt.has_zeros else "float32")
    triples = tiling.pop("triples", uses_triples(fmt, k, isa))
    lut_group = TRIPLE_LUT_GROUP if triples else default_lut_group(k, fmt.group_size)
    # (a quad step covers 32 activations but at 2 bits: 3-bit weights in groups of 16, Q3_K's, take bit planes)
    if tiling.pop("quads", isa.wide_lookup and (triples or fmt.bits in QUAD_CHUNKS and lut_group % quad_step(fmt.bits)
                                                == 0)):
        params["quads"] = True
    if triples:  # 1.67 instead of 2 bits streamed per weight
        fixed, params = (2, k, k, TRIPLE_LUT_GROUP, False), {**params, "triples": True}
    else:
        fixed = (fmt.bits, k, group, lut_group, fmt.has_zeros)
    if tiling:
        return KernelSpec(isa.name, isa.vector_bytes, *fixed, **tiling, **params)
    tuned = tuned_tiling(isa.name, *fixed, triples=triples)
    try:
        return KernelSpec(isa.name, isa.vector_bytes, *fixed, **tuned, **params)
    except ValueError as e:  # a tuning table edited or damaged by hand: the defaults, not an error on every layer
        if tuned:
            warnings.warn(f"tuning.json: ignoring the tiling {tuned} for {isa.name} W{fixed[0]} K={k} ({e})",
                          stacklevel=2)
            return KernelSpec(isa.name, isa.vector_bytes, *fixed, **params)
        raise


def uses_triples(fmt: WeightFormat, k: int, isa) -> bool:
    """Ternary weights with one scale per row or tensor are packed as triples by default on ISAs with 64-entry
    lookups (quads), unless padding K to whole lut groups costs more than the triples save (small K). Elsewhere
    the triples' negation (a mask spread over the lanes, or a k-register load and a masked subtract, per lookup)
    costs more than their 17 % fewer bytes save (docs/decisions.md, "Triples")."""
    return fmt.ternary and fmt.group_size in (PER_ROW, PER_TENSOR) and isa.wide_lookup and padded_k(k) * 5 < k * 6


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


def factor_params(qw: QuantizedWeight, super_groups: int | None = None):
    """K-quant parameters as multipliers and super scales: ``((a, d), (b, m))`` with uint8 ``a, b [M, G]`` and
    float32 ``d, m [M, G/SG]`` (float16 values where any are: ``super_dtype``) such that, in float32, scale = d·a
    and zero = m·b − offset·scale exactly (the kernels' arithmetic); without zeros ``((a, d), None)`` with int8
    ``a``; None where the parameters do not factor so. SG: the format's super group, in groups. Row slices of
    ``PACK_WEIGHTS`` parameters keep the int64 temporaries small beside a 49152-row head's."""
    fmt = qw.format
    sg = super_groups or fmt.groups_per_super
    m, g = qw.scales.shape
    if g % sg:
        return None
    zeros = qw.zeros is not None
    a, d = np.empty((m, g), np.uint8 if zeros else np.int8), np.empty((m, g // sg), np.float32)
    b, mn = (np.empty((m, g), np.uint8), np.empty((m, g // sg), np.float32)) if zeros else (None, None)
    rows = max(1, PACK_WEIGHTS // (8 * g))
    for r0 in range(0, m, rows):
        s = qw.scales[r0:r0 + rows].astype(np.float64)
        n = len(s)
        z = qw.zeros[r0:r0 + rows].astype(np.float64) if zeros else None
        params = (s, z + fmt.offset * s) if zeros else (s,)  # the scale, and m·b: llama.cpp's min
        if not all(np.array_equal(p.astype(np.float32), p) for p in params):
            return None
        factors = [_common_factor(p.reshape(-1, sg), signed=not zeros) for p in params]
        if any(f is None for f in factors):
            return None
        (a_s, d_s), *zero_factors = ((mult.reshape(n, g), base.reshape(n, g // sg)) for mult, base in factors)
        s32 = np.repeat(d_s, sg, axis=1) * a_s.astype(np.float32)
        if not np.array_equal(s32, s.astype(np.float32)):
            return None
        a[r0:r0 + n], d[r0:r0 + n] = a_s, d_s
        if zeros:
            (b_s, m_s), = zero_factors
            z32 = np.repeat(m_s, sg, axis=1) * b_s.astype(np.float32) - np.float32(fmt.offset) * s32
            if not np.array_equal(z32, z.astype(np.float32)):
                return None
            b[r0:r0 + n], mn[r0:r0 + n] = b_s, m_s
    return (a, d), ((b, mn) if zeros else None)


def _common_factor(v: np.ndarray, signed: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """``v [R, n]`` (float32) as ``mult [R, n]`` uint8 (``signed``: int8) times ``base [R, 1]`` float32, exactly,
    with the largest base that is a float16 value (the gcd of each row's values over the least odd divisor that
    shortens it to float16's 11 bits, as far as the multipliers allow), else the largest (the gcd); None where no
    such pair exists."""
    bits = np.ascontiguousarray(v, np.float32).view(np.int32)
    biased = (bits >> 23) & 0xFF
    mant = (bits & 0x7FFFFF) | np.where(biased > 0, 1 << 23, 0)  # v = ±mant·2^(e), e = max(biased, 1) − 150
    e = np.maximum(biased, 1) - 150
    nz = mant != 0
    e_min = np.where(nz, e, 1 << 10).min(axis=1, keepdims=True)
    shift = np.where(nz, e - e_min, 0)
    if (shift > 38).any():  # the shifted values (24 + 38 bits) must fit int64
        return None
    big = mant.astype(np.int64) << shift
    gcd = np.maximum(np.gcd.reduce(big, axis=1, keepdims=True), 1)
    negative = (bits < 0) & nz
    mult = big // gcd
    if signed:  # a positive base, multipliers of either sign
        mult, flip = np.where(negative, -mult, mult), np.zeros_like(gcd, bool)
        if (mult < -128).any() or (mult > 127).any():
            return None
    else:  # one sign a row: the base carries it
        if (negative.any(axis=1) & (nz & ~negative).any(axis=1)).any() or (mult > 255).any():
            return None
        flip = negative.any(axis=1, keepdims=True)
    j = _half_divisor(gcd, np.abs(mult).max(axis=1, keepdims=True), 127 if signed else 255)
    gcd, mult = gcd // j, mult * j
    base = np.ldexp(np.where(flip, -gcd, gcd).astype(np.float64), np.where(nz.any(axis=1, keepdims=True), e_min, 0))
    if not np.array_equal(base.astype(np.float32).astype(np.float64), base):
        return None
    return mult.astype(np.int8 if signed else np.uint8), base.astype(np.float32)


def _half_divisor(gcd: np.ndarray, most: np.ndarray, limit: int) -> np.ndarray:
    """Per row, the least odd j dividing ``gcd`` with an odd part of gcd / j below 2^11 (float16's significand)
    and ``most``·j ≤ ``limit`` (the multipliers, times j, stay bytes); 1 where there is none. A K-quant import's
    gcd is d·gcd(a) and j the odd part of gcd(a): the base is llama.cpp's float16 d again, up to a power of two."""
    odd = gcd // (gcd & -gcd)
    j = np.ones_like(gcd)
    room = limit // np.maximum(most, 1)
    todo = (odd >= 1 << 11) & (room >= 3)
    for c in range(3, int(room[todo].max()) + 1 if todo.any() else 0, 2):
        hit = todo & (odd % c == 0) & (odd // c < 1 << 11) & (c <= room)
        j[hit], todo = c, todo & ~hit
        if not todo.any():
            break
    return j


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


def packed_shapes(spec: KernelSpec, m: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of W and of S (= Z) for ``m`` rows."""
    mb, g, sg = spec.blocks(m), spec.k // spec.group_size, spec.super_groups
    s_shape = (mb, g // sg, (sg + spec.super_bytes) * spec.block_rows) if sg else (mb, g, spec.block_rows)
    if spec.triples:
        return (mb, spec.k_padded // 24, 5 * spec.block_rows), s_shape
    if spec.quads:
        return (mb, spec.k // (4 * spec.step_tables), 4 * len(spec.quad_chunks) * spec.block_rows), s_shape
    return (mb, spec.k // 8, spec.block_rows * spec.bits), s_shape


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
