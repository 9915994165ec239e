"""Every weight format, described once.

A quantized weight row is cut into groups along K. Each group has a float scale ``s`` and optionally a float
zero ``z``; each weight is an unsigned code ``q`` of ``bits`` bits, and

    w = s · (q − 2^(bits−1)) − z

This one convention covers symmetric round-to-nearest (z = 0), asymmetric min/max and GPTQ (z ≠ 0), GGUF Q4_0
(s = d), Q4_1 (s = d, z = −(m + 8d)), TQ1_0/TQ2_0 and BitNet b1.58 (ternary: codes 1, 2, 3 ↔ −1, 0, +1).

Scales and zeros are stored as float16 where the format guarantees every value is exactly one (GGUF's ``d``;
the round-to-nearest quantizers, which round their parameters before choosing codes): at 2 bits and group 128
that is 2.25 instead of 2.5 bits streamed per weight. Otherwise float32, unless an imported tensor's values all
are float16 (``with_half_zeros``). The K-quants' (Q2_K to Q6_K) scales and zeros are multiples of one super scale
per 256 weights (``super_group``; float16 in llama.cpp's files): the kernels stream the multipliers as bytes and the
super scales in float16 where they are float16 values (``tmac.execution.packing``).

``FORMATS`` is the table of named formats (what importers produce); ``WeightFormat.rtn`` builds the
parametric ones the float quantizers produce. Everything else — quantizers, importers, packing, kernels,
serialization — reads its facts (bits, group size, zeros, code range, GGUF block layout) from here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tmac.base import gguf_blocks
from tmac.base.gguf_blocks import GRID_LEVELS

# 5: exact Q5_0/Q5_1/Q5_K imports (4 + 1 planes); 6: Q6_K (4 + 2); 8: Q8_0 (two 4-plane chunks)
BITS = (1, 2, 3, 4, 5, 6, 8)
K_MULTIPLE = 32  # every kernel's K is a multiple of this: its smallest lut group (eight 4-activation tables)
# bits a code takes where codes are bit-packed row-major (token tables): the smallest of 1, 2, 4, 8 holding it
STORAGE_BITS = {b: next(s for s in (1, 2, 4, 8) if s >= b) for b in BITS}
GROUP_SIZES = (16, 32, 64, 128, 256)  # 16: llama.cpp's Q2_K, Q3_K and Q6_K
PER_ROW = "row"
PER_TENSOR = "tensor"
PARAM_DTYPES = ("float16", "float32")  # storage of scales / zeros


def kernels_take(k: int) -> bool:
    """Whether the LUT kernels take ``k`` inputs: a positive multiple of ``K_MULTIPLE``."""
    return k > 0 and k % K_MULTIPLE == 0


def code_offset(bits: int) -> int:
    """The code that means zero at ``bits`` bits, 2^(bits−1), for code that has bits rather than a format (kernels)."""
    return 1 << (bits - 1)


@dataclass(frozen=True)
class GGUFBlock:
    """How a llama.cpp block type stores its weights: GGUF type name, weights and bytes per block (a block holds
    one group of the format, or several: Q4_K's 8)."""

    type_name: str
    block_size: int
    type_size: int

    def decoder(self):
        """The numpy decoder of this block type: ``tmac.base.gguf_blocks.decode_<type>``."""
        return getattr(gguf_blocks, f"decode_{self.type_name.lower()}")

    def code_decoder(self):
        """The decoder of this block type's codes alone (``codes_<type>`` where the type has one, else its
        ``decoder``'s first output), taking the same arguments."""
        codes = getattr(gguf_blocks, f"codes_{self.type_name.lower()}", None)
        if codes is not None:
            return codes
        decode = self.decoder()
        return lambda blocks, offset: decode(blocks, offset)[0]

    def scale_decoder(self):
        """The decoder of this block type's scales and zeros alone (``scales_<type>``), or None where only its
        ``decoder`` reads them."""
        return getattr(gguf_blocks, f"scales_{self.type_name.lower()}", None)

    def super_params(self):
        """The reader of this block type's integer multipliers and super scales (``gguf_blocks.params_<type>``,
        llama.cpp's K-quants), or None where it has none."""
        return getattr(gguf_blocks, f"params_{self.type_name.lower()}", None)


@dataclass(frozen=True)
class WeightFormat:
    name: str
    bits: int
    group_size: int | str  # an int from GROUP_SIZES, PER_ROW or PER_TENSOR
    has_zeros: bool
    ternary: bool = False
    gguf: GGUFBlock | None = None
    scale_dtype: str = "float32"  # one of PARAM_DTYPES: float16 promises every scale is exactly a float16
    zero_dtype: str = "float32"
    # llama.cpp's K-quants: in each run of super_group weights, the scales are integer multiples d·a of one super
    # scale d and the zeros m·b − offset·s of one m (a, b ≤ 255); without zeros a is signed (−128 ≤ a ≤ 127:
    # Q3_K, Q6_K). Kernels then stream a byte per scale and zero plus, a run, d and m in float16 where they are
    # float16 values (llama.cpp's are), else float32 (Q4_K: 4.625 bits a weight instead of 6; Q6_K 6.5625, the
    # file's, instead of 8). None: plain scales and zeros
    super_group: int | None = None
    # non-uniform formats (llama.cpp's IQ4_NL, IQ4_XS): codes index these 2^bits integer levels, w = s·level[q] − z
    # (``offset`` does not apply); kernels look each code up in its activation's table of products with the levels
    codebook: tuple[int, ...] | None = None

    def __post_init__(self):
        check_bits(self.bits)
        check_group_size(self.group_size)
        if self.scale_dtype not in PARAM_DTYPES or self.zero_dtype not in PARAM_DTYPES:
            raise ValueError(f"format {self.name}: scale/zero dtypes must be in {PARAM_DTYPES}, got "
                             f"{self.scale_dtype!r}/{self.zero_dtype!r}")
        if self.ternary and (self.bits != 2 or self.has_zeros):
            raise ValueError(f"format {self.name}: ternary weights are stored as 2-bit codes without zeros")
        if self.super_group is not None and not (isinstance(self.group_size, int) and not self.ternary and
                                                 self.super_group % self.group_size == 0):
            raise ValueError(f"format {self.name}: super_group {self.super_group} needs a multiple of an int group "
                             f"size (got {self.group_size}) and non-ternary codes")
        if self.codebook is not None:
            check_codebook(self.codebook, self.bits)
            if self.ternary or self.has_zeros:
                raise ValueError(f"format {self.name}: a codebook's levels are symmetric codes, without zeros")

    @property
    def offset(self) -> int:
        """The code that means zero: w = s·(q − offset) − z."""
        return code_offset(self.bits)

    @property
    def groups_per_super(self) -> int:
        """Weight groups sharing one super scale (``super_group``); 0 for plain parameters."""
        return self.super_group // self.group_size if self.super_group else 0

    @property
    def code_range(self) -> tuple[int, int]:
        """Smallest and largest valid code (ternary uses 1..3 of the 2-bit range)."""
        return (1, 3) if self.ternary else (0, (1 << self.bits) - 1)

    def levels(self, codes):
        """The integer level each code means (float64): ``codebook[q]``, or ``q − offset``."""
        import numpy as np

        if self.codebook is not None:
            return np.asarray(self.codebook, np.float64)[codes]
        return codes.astype(np.float64) - self.offset

    def groups_per_row(self, k: int) -> int:
        """How many scale groups one row of length ``k`` has (raises if the group size does not divide k)."""
        if self.group_size in (PER_ROW, PER_TENSOR):
            return 1
        if k % self.group_size:
            raise ValueError(f"in_features K={k} is not divisible by group_size={self.group_size} ({self.name})")
        return k // self.group_size

    def scale_shape(self, m: int, k: int) -> tuple[int, int]:
        if self.group_size == PER_TENSOR:
            return (1, 1)
        return (m, self.groups_per_row(k))

    @property
    def takes_half_zeros(self) -> bool:
        """Whether a tensor of this format whose zeros all are float16 values is better stored with float16 zeros
        (``with_half_zeros``): not where they are float16 already, nor for K-quants, whose byte multipliers stream
        less."""
        return self.has_zeros and self.zero_dtype != "float16" and self.super_group is None

    def with_half_zeros(self) -> "WeightFormat":
        """This format with float16 zeros, for a tensor whose zeros all happen to be float16 values (Q4_1's
        −(m + 8d) nearly always is: 5.0 instead of 5.5 bits streamed per weight)."""
        return dataclasses.replace(self, name=f"{self.name}_zh", gguf=None, zero_dtype="float16", super_group=None)

    def per_row(self) -> "WeightFormat":
        """This format with one scale per row (fused rows of per-tensor parts; GGUF blocks sharing a scale)."""
        return dataclasses.replace(self, name=f"{self.name}_rows", group_size=PER_ROW, gguf=None, super_group=None)

    def to_dict(self) -> dict:
        return {"name": self.name, "bits": self.bits, "group_size": self.group_size, "has_zeros": self.has_zeros,
                "ternary": self.ternary, "scale_dtype": self.scale_dtype, "zero_dtype": self.zero_dtype,
                **({"super_group": self.super_group} if self.super_group is not None else {}),
                **({"codebook": list(self.codebook)} if self.codebook is not None else {})}

    @staticmethod
    def from_dict(d) -> "WeightFormat":
        """The inverse of ``to_dict``, for metadata read from files (validated like any other format). Files
        written before parameters could be float16 lack the dtype keys: theirs are float32."""
        keys = {"name", "bits", "group_size", "has_zeros", "ternary"}
        dtypes = {"scale_dtype", "zero_dtype"}
        optional = {"super_group", "codebook"}
        if not isinstance(d, dict) or not (keys <= set(d) <= keys | dtypes | optional) or \
                (set(d) - keys and not dtypes <= set(d)):
            raise ValueError(f"a weight format needs exactly the keys {sorted(keys | dtypes)} (and super_group, "
                             f"codebook), got {d!r:.200}")
        if not isinstance(d["name"], str) or type(d["has_zeros"]) is not bool or type(d["ternary"]) is not bool or \
                type(d.get("super_group", 0)) is not int or type(d.get("codebook", [])) is not list:
            raise ValueError(f"malformed weight format {d!r:.200}")
        if "codebook" in d:
            d = {**d, "codebook": tuple(d["codebook"])}
        fmt = WeightFormat(**d)
        named = FORMATS.get(fmt.name)
        return named if named is not None and named.to_dict() == fmt.to_dict() else fmt

    @staticmethod
    def rtn(bits: int, group_size: int | str = 128, symmetric: bool = False, half: bool = True) -> "WeightFormat":
        """The format of round-to-nearest quantization from float: e.g. ``w2g128`` (asym) or ``w4g32s`` (sym);
        ``half=False`` (name suffix ``f32``) keeps float32 parameters, for weights whose scales float16 cannot
        hold."""
        check_bits(bits)
        check_group_size(group_size)
        dtype = "float16" if half else "float32"
        return WeightFormat(f"w{bits}g{group_size}{'s' if symmetric else ''}{'' if half else 'f32'}", bits,
                            group_size, has_zeros=not symmetric, scale_dtype=dtype, zero_dtype=dtype)

    @staticmethod
    def ternary_format(group_size: int | str = PER_TENSOR) -> "WeightFormat":
        check_group_size(group_size)
        return WeightFormat(f"ternary_g{group_size}", 2, group_size, has_zeros=False, ternary=True)


def check_bits(bits) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"bits must be an int in {BITS}, got {type(bits).__name__}")
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")


def check_codebook(codebook, bits: int) -> None:
    """A codebook is 2^bits distinct integer levels in int8's range, so that its tables are exact products."""
    if not isinstance(codebook, tuple) or len(codebook) != 1 << bits or \
            any(type(v) is not int or not -128 <= v <= 127 for v in codebook) or len(set(codebook)) != len(codebook):
        raise ValueError(f"a {bits}-bit codebook needs {1 << bits} distinct integers in [-128, 127], "
                         f"got {codebook!r:.200}")


def default_group_size(k: int) -> int | None:
    """The group size a layer of ``k`` inputs is requantized with by default: the largest of 128, 64, 32 dividing
    it (None: none does)."""
    return next((g for g in (128, 64, 32) if k % g == 0), None)


def check_group_size(group_size) -> None:
    if isinstance(group_size, str):
        if group_size not in (PER_ROW, PER_TENSOR):
            raise ValueError(f"group_size must be one of {GROUP_SIZES}, '{PER_ROW}' or '{PER_TENSOR}', got {group_size!r}")
        return
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int or '{PER_ROW}'/'{PER_TENSOR}', got {type(group_size).__name__}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, '{PER_ROW}' or '{PER_TENSOR}', got {group_size}")


# The named formats importers produce. GGUF block layouts follow ggml-common.h:
#   Q8_0  {f16 d; i8 qs[32]}                 w = d·q                 code q + 128
#   Q4_0  {f16 d; u8 qs[16]}                 w = d·(q − 8)           q = low nibbles (j) then high nibbles (j+16)
#   Q4_1  {f16 d; f16 m; u8 qs[16]}          w = d·q + m
#   TQ2_0 {u8 qs[64]; f16 d}                 w = d·(q − 1), q ∈ {0,1,2}, 2-bit fields
#   TQ1_0 {u8 qs[48]; u8 qh[4]; f16 d}       w = d·(q − 1), q ∈ {0,1,2}, base-3 digits packed 5 (qs) / 4 (qh) per byte
#   Q5_0  {f16 d; u8 qh[4]; u8 qs[16]}        w = d·(q − 16)          q: Q4_0's nibble | bit j of qh (LE) << 4
#   Q5_1  {f16 d; f16 m; u8 qh[4]; u8 qs[16]} w = d·q + m
#   Q4_K  {f16 d; f16 dmin; u8 sc[12]; u8 qs[128]}  w = d·a_j·q − dmin·b_j for group j of 32 (8 a block; a_j, b_j:
#         6 bits, packed in sc); q: low nibbles of 32 bytes (group 2i), then their high nibbles (group 2i + 1)
#   Q5_K  {f16 d; f16 dmin; u8 sc[12]; u8 qh[32]; u8 qs[128]}  as Q4_K, q | bit j of qh[l] << 4 (weight l of group j)
#   Q2_K  {u8 sc[16]; u8 qs[64]; f16 d; f16 dmin}  w = d·a_j·q − dmin·b_j for group j of 16 (a_j, b_j: low, high nibble
#         of sc[j]); q: 2-bit fields, weight 128h + 32i + l at bits 2i of qs[32h + l] (as TQ2_0)
#   Q3_K  {u8 hmask[32]; u8 qs[64]; u8 sc[12]; f16 d}  w = d·(a_j − 32)·(q − 4) for group j of 16 (a_j: 6 bits, low
#         nibbles of sc[0..7] then their high nibbles, | 2-bit fields of sc[8..11] << 4); q: Q2_K's 2 bits | bit i of
#         hmask[l] << 2 for weight 32i + l
#   IQ4_NL {f16 d; u8 qs[16]}                w = d·IQ4_LEVELS[q]     q: as Q4_0
#   IQ4_XS {f16 d; u16 sh; u8 sl[4]; u8 qs[128]}  w = d·(a_j − 32)·IQ4_LEVELS[q] for group j of 32 (a_j: nibble j % 2
#         of sl[j // 2] | bits 2j of sh << 4); q: as Q4_0 within each group's 16 bytes
#   Q6_K  {u8 ql[128]; u8 qh[64]; i8 sc[16]; f16 d}  w = d·sc_j·(q − 32) for group j of 16; weight 128h + 32i + l:
#         nibble i // 2 of ql[64h + 32(i % 2) + l] | bits 2i of qh[32h + l] << 4
#   The grid i-quants store indices into llama.cpp's grids of 8 (IQ2, IQ1) or 4 (IQ3) magnitudes and a sign bit a
#   weight (IQ1: none, but a shift ±⅛ per 8 or 32 weights); gguf-py's quants module holds the grids. Each weight is
#   one of at most 16 integer levels (``gguf_blocks.GRID_LEVELS``) times its group's scale, so they import as 4-bit
#   codebook codes (a grid index would be one lookup only in a table of all its weights' activations, and their signs
#   differ row by row); on AVX-512 VBMI the kernels of IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_M and IQ1_S expand
#   them from their indices and signs (IQ1's shifts), held at their own size (``tmac.quant.layout.GridQuads``):
#   IQ2_XXS {f16 d; u32 qs[16]}  per 32: u32 of 4 grid indices, u32 of 4 × 7 sign bits (ksigns: the 8th is the parity)
#         and a 4-bit s; w = d·(2s + 1)/8 · ±grid, grid ∈ {8, 25, 43}
#   IQ2_XS {f16 d; u16 qs[32]; u8 sc[8]}  per 8: 9-bit index | 7 sign bits << 9; s per 16 (nibbles of sc)
#   IQ2_S  {f16 d; u8 qs[32]; u8 sg[32]; u8 qh[8]; u8 sc[8]}  per 8: index qs | 2 bits of qh << 8, sign byte; s per 16
#   IQ3_XXS {f16 d; u8 qs[64]; u32 ss[8]}  per 4: index; per 32: 4 × 7 sign bits, s; w = d·(2s + 1)/4 · ±grid,
#         grid ∈ {4, 12, .. 52, 62}
#   IQ3_S  {f16 d; u8 qs[64]; u8 qh[8]; u8 sg[32]; u8 sc[4]}  per 4: index qs | bit of qh << 8; w = d·(2s + 1)·±grid,
#         grid ∈ {1, 3, .., 15}, s per 32
#   IQ1_S  {f16 d; u8 qs[32]; u16 qh[8]}  per 32: qh = 4 × 3 index bits, s (3 bits), delta sign; w = d·(2s + 1)·
#         (grid ± ⅛), grid ∈ {−1, 0, 1}: not codes but a K-quant of 2-bit codes q = grid + 1, w = d·a·q − (d/8)·b with
#         a = 2s + 1, b = 7a (+⅛) or 9a (−⅛): its delta is one a group, as a min (where kernels expand grids, held
#         as its indices: ``IQ1_S_AS_CODES``)
#   IQ1_M  {u8 qs[32]; u8 qh[16]; u16 sc[4]}  d: the top nibbles of sc; per 8: 3 index bits and the delta's sign (a
#         nibble of qh); s per 16 (3 bits)
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # llama.cpp's kvalues_iq4nl

FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        WeightFormat("q8_0", 8, 32, has_zeros=False, gguf=GGUFBlock("Q8_0", 32, 34), scale_dtype="float16"),
        WeightFormat("q4_0", 4, 32, has_zeros=False, gguf=GGUFBlock("Q4_0", 32, 18), scale_dtype="float16"),
        # the zero −(m + 8d) of two float16s is not a float16 in general
        WeightFormat("q4_1", 4, 32, has_zeros=True, gguf=GGUFBlock("Q4_1", 32, 20), scale_dtype="float16"),
        WeightFormat("q5_0", 5, 32, has_zeros=False, gguf=GGUFBlock("Q5_0", 32, 22), scale_dtype="float16"),
        WeightFormat("q5_1", 5, 32, has_zeros=True, gguf=GGUFBlock("Q5_1", 32, 24), scale_dtype="float16"),
        WeightFormat("tq1_0", 2, 256, has_zeros=False, ternary=True, gguf=GGUFBlock("TQ1_0", 256, 54),
                     scale_dtype="float16"),
        WeightFormat("tq2_0", 2, 256, has_zeros=False, ternary=True, gguf=GGUFBlock("TQ2_0", 256, 66),
                     scale_dtype="float16"),
        # scale d·a (a float32 value), zero dmin·b − 8·d·a: imported where every zero is a float32 value
        WeightFormat("q4_k", 4, 32, has_zeros=True, gguf=GGUFBlock("Q4_K", 256, 144), super_group=256),
        WeightFormat("q5_k", 5, 32, has_zeros=True, gguf=GGUFBlock("Q5_K", 256, 176), super_group=256),
        WeightFormat("q2_k", 2, 16, has_zeros=True, gguf=GGUFBlock("Q2_K", 256, 84), super_group=256),
        # scale d·a with a signed multiplier, no zeros
        WeightFormat("q3_k", 3, 16, has_zeros=False, gguf=GGUFBlock("Q3_K", 256, 110), super_group=256),
        WeightFormat("q6_k", 6, 16, has_zeros=False, gguf=GGUFBlock("Q6_K", 256, 210), super_group=256),
        WeightFormat("iq4_nl", 4, 32, has_zeros=False, gguf=GGUFBlock("IQ4_NL", 32, 18), scale_dtype="float16",
                     codebook=IQ4_LEVELS),
        WeightFormat("iq4_xs", 4, 32, has_zeros=False, gguf=GGUFBlock("IQ4_XS", 256, 136), super_group=256,
                     codebook=IQ4_LEVELS),
        *(WeightFormat(name.lower(), 4, group, has_zeros=False, gguf=GGUFBlock(name, 256, size), super_group=256,
                       codebook=GRID_LEVELS[name])
          for name, group, size in (("IQ2_XXS", 32, 66), ("IQ2_XS", 16, 74), ("IQ2_S", 16, 82), ("IQ3_XXS", 32, 98),
                                    ("IQ3_S", 32, 110), ("IQ1_M", 16, 56))),
        # IQ1_S as a K-quant of 2-bit codes grid + 1: scale d·(2s + 1), zero (d/8)·b (the delta)
        WeightFormat("iq1_s", 2, 32, has_zeros=True, gguf=GGUFBlock("IQ1_S", 256, 50), super_group=256),
        WeightFormat("bitnet", 2, PER_TENSOR, has_zeros=False, ternary=True),
    )
}

GGUF_EXACT = {f.gguf.type_name: f for f in FORMATS.values() if f.gguf is not None}
# IQ1_S where the kernels expand its grid (``Isa.expands_grids``): IQ1_M's codebook codes (grid + 1) | shift << 2 in
# groups of 32, scale d·(2s + 1)/8. Not an import (a file's IQ1_S imports as the row above) but the form those kernels
# hold it in, made from that row at packing and back at unpacking (``tmac.quant.held``)
IQ1_S_AS_CODES = WeightFormat("iq1_s_codes", 4, 32, has_zeros=False, gguf=GGUFBlock("IQ1_S", 256, 50), super_group=256,
                              codebook=GRID_LEVELS["IQ1_S"])
GGUF_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")  # stored as floats: kept float, not requantized to 8 bits
# quantize_weight's arguments for Q8_0's layout: what loaders keep near-lossless at 8 bits (the token table and the
# head of a requantized model, matrices of GGUF types without an exact import)
Q8_0_LAYOUT = dict(bits=8, group_size=32, symmetric=True)
