"""``KernelSpec``: everything a compiled LUT kernel is specialized on, its validation, and the shapes of the buffers
it reads (the byte layout of its weights is its ``layout``'s, ``tmac.quant.layout``; of scales, zeros and K chunks
``tmac.execution.packing``'s). A record: which spec serves a format is ``tmac.quant.choose``'s decision."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

import numpy as np

from tmac.base.formats import K_MULTIPLE, PARAM_DTYPES, check_bits, check_codebook, kernels_take
from tmac.kernels import ISAS
from tmac.quant.layout import Layout, layout_of
from tmac.base.reference import QUANT_BLOCK, padded_k

LUT_FUNCTIONS = ("build_tables", "lut_gemv", "lut_gemm")
DOT_FUNCTIONS = ("quantize_rows", "dot_gemm")
# codes the dot-product GEMM takes: 2-bit codes look up two planes, as cheap as a dot product (measured); 8-bit ones
# would overflow vpmaddubsw's pairs
DOT_BITS = (3, 4, 5, 6)

# activation rows from which ``build_tables`` runs on the thread pool: a parallel launch costs more than one row's
# tables take (the few rows of a batched decode step stay serial; a prefill's go parallel)
PARALLEL_TABLE_ROWS = 16
MAX_SUPER_EXPONENT = 24  # (float16's subnormals reach 2^−24)


@dataclass(frozen=True)
class KernelSpec:
    """Everything a compiled LUT kernel is specialized on. M and N are runtime sizes, not part of it."""

    isa: str  # a tmac.kernels.ISAS name: the vector width and every other fact of the ISA come from there
    bits: int
    k: int
    group_size: int  # activations per weight scale (K for per-row and per-tensor weights)
    lut_group: int  # activations per table scale; divides group_size
    has_zeros: bool
    # the tiling (tmac.quant.choose picks it; 0 is refused): rows of a weight block, activation rows sharing each weight
    # load in the GEMM kernel, table pairs unrolled in the inner loop, and (last) activations per K chunk
    block_rows: int = 0
    n_tile: int = 0
    unroll: int = 0
    scale_dtype: str = "float32"  # storage of S and Z: the format's (tmac.base.formats.PARAM_DTYPES); super scales'
    zero_dtype: str = "float32"  # with super_groups (one dtype for both)
    triples: bool = False  # ternary weights three to an index + sign (1.67 bits), instead of 2 bit planes
    quads: bool = False  # a row's 4 bytes look into four tables at once (64-entry lookups): 1-3, 5 bits, triples
    super_groups: int = 0  # weight groups sharing one super scale of the scales and zeros (K-quants); 0: plain S, Z
    k_chunk: int = 0
    codebook: tuple = ()  # a codebook format's levels (tmac.base.formats): one activation to a table; (): bit planes
    grid: str = ""  # quads of codebook codes held as this grid i-quant's indices and signs (tmac.quant.layout.GridQuads)
    # super scales stored times 2^super_exponent, the kernels scaling their sums back: float16 where llama.cpp's d
    # over a power of two (IQ2's d/8) falls below float16's normal range
    super_exponent: int = 0

    def __post_init__(self):
        check_bits(self.bits)
        if not isinstance(self.isa, str) or self.isa not in ISAS:
            raise ValueError(f"invalid kernel spec: ISA {self.isa!r:.50} is not one of {', '.join(ISAS)} (tmac.kernels)")
        if self.codebook:
            check_codebook(self.codebook, self.bits)
        if not isinstance(self.grid, str):
            raise ValueError(f"invalid kernel spec: grid {self.grid!r:.50} is not a string")
        layout = layout_of(self.bits, self.triples, self.quads, self.codebook, self.grid)
        object.__setattr__(self, "_layout", layout)
        k, g, lg, bm, vl = self.k, self.group_size, self.lut_group, self.block_rows, self.vector_bytes
        problems = []
        if self.grid and not (self.quads and ISAS[self.isa].expands_grids):
            problems.append(f"grid {self.grid} needs quads on an ISA that expands grids, not {self.isa}")
        if not kernels_take(k):
            problems.append(f"K={k} must be a positive multiple of {K_MULTIPLE}")
        if g <= 0 or k % g:
            problems.append(f"group_size={g} does not divide K={k}")
        problems += layout.problems(self)
        if problems:  # the sizes below derive from a valid layout
            raise ValueError("invalid kernel spec: " + "; ".join(problems))
        steps = self.steps_per_lut_group
        if bm <= 0 or bm % vl:
            problems.append(f"block_rows={bm} must be a positive multiple of the vector width {vl}")
        if self.n_tile < 1 or self.unroll < 1 or not steps or steps % self.unroll:
            problems.append(f"n_tile={self.n_tile}, unroll={self.unroll}: unroll must divide the "
                            f"{steps} steps of a lut group")
        if self.super_groups and (self.super_groups < 2 or self.super_groups % 2 or lg != g or
                                  k % (g * self.super_groups)):
            problems.append(f"super_groups={self.super_groups} needs lut_group = group_size, an even count and must "
                            f"divide the K/group_size={k // g} groups")
        if self.super_exponent and not (self.super_groups and 0 < self.super_exponent <= MAX_SUPER_EXPONENT):
            problems.append(f"super_exponent={self.super_exponent} needs super groups and at most {MAX_SUPER_EXPONENT}")
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
    def vector_bytes(self) -> int:
        return ISAS[self.isa].vector_bytes

    @property
    def layout(self) -> Layout:
        """How the weight bytes are laid out (``tmac.quant.layout``): bit planes, triples or quads."""
        return self._layout

    def step_vectors(self, block_rows: int) -> int:
        """Weight vectors a block of ``block_rows`` rows reads per step."""
        return self._layout.step_vectors(block_rows, self.vector_bytes)

    @property
    def steps_per_lut_group(self) -> int:
        """Inner-loop steps per lut group: table pairs (8 activations), triple steps (24) or quad steps (32 at
        1 bit, 16 at 2 bits)."""
        per = self._layout.step_activations
        return self.lut_group // per if self.lut_group > 0 and self.lut_group % per == 0 else 0

    def unrolls(self) -> list[int]:
        """Unroll factors worth trying, largest first: at most 8 table pairs per unrolled body (a triple step is
        4, a quad step 4 at 1 bit and 2 at 2 bits)."""
        pairs = self._layout.step_tables // 2
        return [u for u in (8, 4, 2, 1) if u * pairs <= 8 and self.steps_per_lut_group % u == 0]

    @property
    def k_padded(self) -> int:
        """Activations the tables cover: K, or K rounded up to whole lut groups for triples."""
        return self._layout.codes.k_padded(self.k)

    def table_shapes(self, rows: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """Shapes of LUT (int8), LS and XS (float32) for ``rows`` activation rows."""
        kp = self.k_padded
        return (rows, kp // self._layout.codes.per_table, 16), (rows, kp // self.lut_group), \
            (rows, self.k // self.group_size)

    @property
    def name(self) -> str:
        z = "z" if self.has_zeros else "s"
        half = ("_sh" if self.scale_dtype == "float16" else "") + \
            ("_zh" if self.has_zeros and self.zero_dtype == "float16" else "") + self._layout.suffix + \
            (f"_ks{self.super_groups}" if self.super_groups else "") + \
            (f"_kc{self.k_chunk}" if self.k_chunk < self.k_padded else "") + \
            (f"_cb{_levels_hash(self.codebook)}" if self.codebook else "") + \
            (f"_{self.grid.lower()}" if self.grid else "") + (f"_se{self.super_exponent}" if self.super_exponent else "")
        return (f"lut_{self.isa}_b{self.bits}_k{self.k}_g{self.group_size}_lg{self.lut_group}{z}"
                f"_bm{self.block_rows}_nt{self.n_tile}_u{self.unroll}{half}")

    @property
    def dot_products(self) -> bool:
        """Whether its library also has the dot-product GEMM for many rows (``quantize_rows``, ``dot_gemm``:
        codegen/dot.py), on an ISA with dot products (``Isa.dot_rows``): bit-plane codes of 3 to 6 bits (not quads,
        whose 64-entry lookups serve 3 and 5 bits on AVX-512 VBMI), 2-bit ones in super groups of 32-weight groups
        where the ISA says so (``Isa.dot_two_bit_super_groups``: IQ1_S on x86), and codebook codes (the i-quants, in
        either layout) where the ISA multiplies their levels (``Isa.dot_codebooks``)."""
        isa = ISAS[self.isa]
        if isa.dot_rows <= 0 or self.triples or not (self.group_size % QUANT_BLOCK == 0 or self.group_size == 16):
            return False
        if self.codebook:
            return isa.dot_codebooks
        if self.bits == 2 and self.super_groups and self.group_size >= QUANT_BLOCK:  # IQ1_S's K-quant form
            return isa.dot_two_bit_super_groups and not self.quads
        return self.bits in DOT_BITS and not self.quads

    @property
    def activation_block(self) -> int:
        """Activations per int8 scale in the dot-product GEMM: a super group's (256 for llama.cpp's K-quants, as its
        Q8_K), where its multipliers then sum in integers and d·dx multiplies once; else a block of 32."""
        return self.group_size * self.super_groups if self.super_groups else QUANT_BLOCK

    @property
    def functions(self) -> tuple[str, ...]:
        """What its library exports."""
        return LUT_FUNCTIONS + (DOT_FUNCTIONS if self.dot_products else ())

    def to_json(self) -> str:
        """The spec as saved files and checksums hold it: its fields and the ISA's vector width (which files have
        always carried; ``from_dict`` checks it)."""
        return json.dumps({**self.record(), "vector_bytes": self.vector_bytes}, sort_keys=True)

    def record(self) -> dict:
        """The fields as JSON holds them (``from_dict`` reads them back): the levels a list, and a bit-plane spec
        without the ``codebook`` field, as written before there was one (kernel caches and saved files stay
        valid)."""
        fields_ = asdict(self)
        if self.codebook:
            fields_["codebook"] = list(self.codebook)
        else:
            del fields_["codebook"]
        for name in ("grid", "super_exponent"):  # (absent where unused, as before they existed)
            if not fields_[name]:
                del fields_[name]
        return fields_

    @classmethod
    def from_dict(cls, d) -> "KernelSpec":
        """A spec from JSON; specs written before the later fields existed lack them (float32, bit planes)."""
        names = {f.name for f in fields(cls)}
        strings = {"isa", "scale_dtype", "zero_dtype", "grid"}
        if isinstance(d, dict) and "codebook" in d:  # JSON's list
            if not isinstance(d["codebook"], list):
                raise ValueError(f"kernel spec field 'codebook' must be a list of levels, got {d['codebook']!r:.50}")
            d = {**d, "codebook": tuple(d["codebook"])}
        if isinstance(d, dict) and "vector_bytes" in d:  # the ISA's, said again (to_json)
            d = dict(d)
            width, isa = d.pop("vector_bytes"), ISAS.get(d.get("isa")) if isinstance(d.get("isa"), str) else None
            if isa is not None and (type(width) is not int or width != isa.vector_bytes):
                raise ValueError(f"kernel spec field 'vector_bytes' is {width!r:.50}, but ISA {isa.name} has "
                                 f"{isa.vector_bytes}-byte vectors")
        if isinstance(d, dict) and set(d) < names and names - set(d) <= set(_LATER_FIELDS):
            d = {**{f: _LATER_FIELDS[f] for f in names - set(d)}, **d}
            if d["k_chunk"] is None:  # written before K chunks: one chunk of all of K
                k = d.get("k")
                d["k_chunk"] = (padded_k(k) if d.get("triples") is True else k) if type(k) is int and k > 0 else 0
        if not isinstance(d, dict) or set(d) != names:
            raise ValueError(f"a kernel spec needs exactly the fields {sorted(names)}, got {d!r:.200}")
        for name in names - strings - {"codebook"}:
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
                 "super_groups": 0, "k_chunk": None, "codebook": (), "grid": "",
                 "super_exponent": 0}  # old meaning (k_chunk: all of K)


def _levels_hash(levels: tuple) -> str:
    import hashlib

    return hashlib.blake2b(repr(levels).encode(), digest_size=4).hexdigest()


def packed_shapes(spec: KernelSpec, m: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of W and of S (= Z) for ``m`` rows."""
    mb, g, sg = spec.blocks(m), spec.k // spec.group_size, spec.super_groups
    s_shape = (mb, g // sg, (sg + spec.super_bytes) * spec.block_rows) if sg else (mb, g, spec.block_rows)
    return spec.layout.weight_shape(mb, spec.k, spec.block_rows), s_shape
