"""``GlueSpec``: the compiled code that runs between the LUT projections of one decode step.

Eager PyTorch spends ~20 small ops per layer on RMSNorm, RoPE, the KV-cache write, single-token attention and
the gated activation, each dispatched on its own — together more than the projections on a small model. The
glue kernels do each of those stretches in one call (``tmac.codegen.glue`` generates them):

- ``norm_in(x, delta, w, eps, out)``: the residual ``x += delta`` (Granite: ``x += r·delta``), then ``out = rmsnorm(x)·w`` (``norm_final``
  is the same function for the head, a separate symbol so a profile tells them apart);
- ``add_in(x, delta, out)``: ``norm_in`` without the norm, ``out = x += delta`` (no input norms: OLMo 2);
- ``norm_q(q, w, eps, out)``, ``norm_k``: OLMo 2's norms of q and k, each over all its heads, in place;
- ``norm_attn(x, w, eps, out)``, ``norm_hidden``: BitNet's norms before the output and down projections
  (``sub_norms``);
- ``quantize_dim(x)``, ``quantize_q``, ``quantize_ffn``: int8 absmax fake-quantization in place, in front of
  projections that carry it (BitNet and llama.cpp's ternary types; ``act_quant``);
- ``attend(qkv, [bias,] [q_norm, k_norm, eps,] cos, sin, cache_k, cache_v, scores, pos, [window,] out)``
  (``GlueSpec.attend_args``): the q/k/v biases added and q and k normalized per head where the family has them,
  RoPE on q and k (on their leading ``rotary_dim`` dimensions), the cache write at ``pos``, and attention of every
  head over positions ``0..pos`` (grouped-query), or the last ``window`` of them, scores soft-capped where the
  family caps them (``softcap``, Gemma 2);
- ``norm_post_attn(delta, w, eps, out)``, ``norm_post_ffn``: Gemma's norms on the attention's and the FFN's
  outputs (``post_norms``);
- ``gated_act(gate_up, out)``: ``act(gate)·up`` (SiLU for Llama, squared ReLU for BitNet, GeLU-tanh for Gemma);
- ``NAME_rows``, for each function of one row above but ``norm_final``: the same on every row of ``[rows, n]``
  buffers, rows in parallel (a prefill's chunk); ``attend_rows(..., pos, last, ...)`` takes row r as position
  ``pos + min(r, last)`` of one sequence, writes every new position, then attends each row up to its own;
- ``embed(codes, scales[, zeros], token, out)``: row ``token`` of a quantized token table (``tmac.Embedding``,
  described by the ``embed_*`` fields) dequantized into ``out``: one call instead of a dozen torch or numpy
  operations, slow right after the weight stream has evicted the interpreter's working set; with ``embed_blocks``
  ``embed(blocks, token, out)`` reads the row from a GGUF table's own blocks (``StreamedEmbedding``: Q8_0).
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass, field, fields

from tmac.base.formats import PARAM_DTYPES, STORAGE_BITS

ACTIVATIONS = ("silu", "relu2", "gelu_tanh")
KV_DTYPES = ("float16", "float32")
# The KV cache layout, shared by the glue and the eager model: values ``[kv heads, positions, head_dim]``; keys in
# blocks of KV_BLOCK positions, transposed, ``[kv heads, positions / KV_BLOCK, head_dim, KV_BLOCK]``, so that a
# query scores a block's positions as one vector (a multiply-add per head dimension) instead of folding a
# ``head_dim``-long dot product across lanes for every position. Positions are allocated in whole blocks.
KV_BLOCK = 16
# query-key products (positions × heads × head_dim) from which ``attend``'s phases run on the thread pool: from
# position 170 for SmolLM2's 9 heads of 64, 47 for the 1B shape's 32
PARALLEL_ATTENTION_WORK = 96 * 1024



EMBED_BLOCKS = ("", "Q8_0")  # the GGUF block types whose rows ``embed`` reads from a file's table
ROWS = "_rows"  # the suffix of a glue function's batched variant (``GlueSpec.row_functions``)


def check_kv_dtype(kv_dtype) -> None:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")


def _variation(tag: str, default=False):
    return field(default=default, metadata={"tag": tag})


def _tag(tag: str, default, value) -> str:
    """A variation's part of a kernel name: nothing at its default; a float by its float32 bits (exact, no dots)."""
    if value == default:
        return ""
    if isinstance(value, bool):
        return f"_{tag}" if value else f"_no{tag}"
    if isinstance(value, float):
        return f"_{tag}{struct.pack('>f', value).hex()}"
    return f"_{tag}{value}"


@dataclass(frozen=True)
class GlueSpec:
    isa: str
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    act: str
    sub_norms: bool
    act_quant: bool
    kv_dtype: str = "float16"  # of the KV cache: float16 halves what attention reads per token (as llama.cpp)
    embed_bits: int = 0  # the quantized token table's code bits (``embed``); 0: a float table, no ``embed``
    embed_groups: int = 0  # its scale groups a row; 0: one scale for the whole table
    embed_scale: str = "float32"  # the storage of its scales, and of its zeros ("" without)
    embed_zero: str = ""
    embed_blocks: str = ""  # "Q8_0": ``embed`` reads a row of a GGUF table's own blocks (``StreamedEmbedding``)
    # the family's variations: each field's ``tag`` names it in the kernel's name where it is away from its default
    # (``_TAG``, ``_noTAG`` for a default-on switch turned off, ``_TAG`` + its value for a number)
    qkv_bias: bool = _variation("qb")  # ``attend`` adds the q/k/v biases (Qwen2)
    qk_norm: bool = _variation("qkn")  # ``attend`` normalizes each q and k head before RoPE (Qwen3, Gemma 3)
    rotary_dim: int = _variation("r", 0)  # dimensions of a head RoPE turns; 0: all
    attn_scale: float = _variation("s", 0.0)  # the scores' scale; 0: head_dim^-½
    window: bool = _variation("win")  # ``attend`` takes a sliding window (0: none)
    post_norms: bool = _variation("post")  # Gemma's norms on the attention's and the FFN's outputs
    softcap: float = _variation("c", 0.0)  # Gemma 2: ``attend`` caps the scores s to c·tanh(s/c); 0: none
    residual_scale: float = _variation("rs", 0.0)  # Granite: ``norm_in``/``norm_final`` add ``delta`` times it; 0: times 1
    pre_norms: bool = _variation("pre", True)  # False (OLMo 2): ``add_in`` instead of ``norm_in``, the residual added, not normalized
    qk_norm_whole: bool = _variation("qkw")  # OLMo 2: ``norm_q``/``norm_k`` normalize all of q's heads (k's) as one vector

    def __post_init__(self):
        if self.rotary_dim == self.head_dim:  # (all of a head: one name for one computation)
            object.__setattr__(self, "rotary_dim", 0)
        sizes = (self.dim, self.n_heads, self.n_kv_heads, self.head_dim, self.ffn_dim)
        if not all(type(v) is int and v > 0 for v in sizes) or self.n_heads % self.n_kv_heads or self.head_dim % 2:
            raise ValueError(f"invalid glue spec sizes: dim, heads, kv heads, head_dim, ffn = {sizes}")
        if self.act not in ACTIVATIONS:
            raise ValueError(f"activation {self.act!r} has no glue kernel; known: {ACTIVATIONS}")
        check_kv_dtype(self.kv_dtype)
        if type(self.rotary_dim) is not int or self.rotary_dim % 2 or not 0 <= self.rotary_dim <= self.head_dim or \
                not 0 <= self.attn_scale <= 10 or not 0 <= self.softcap <= 1e4 or not 0 <= self.residual_scale <= 1e4:
            raise ValueError(f"invalid glue spec attention: rotary_dim {self.rotary_dim!r:.20} of head_dim "
                             f"{self.head_dim}, scale {self.attn_scale!r:.20}, soft cap {self.softcap!r:.20}, residual scale "
                             f"{self.residual_scale!r:.20}")
        if self.embed_blocks not in EMBED_BLOCKS or self.embed_blocks and self.embed_bits:
            raise ValueError(f"invalid token table for the glue: blocks {self.embed_blocks!r:.20} (one of "
                             f"{EMBED_BLOCKS}, without embed_bits)")
        if self.embed_bits and (self.embed_bits not in STORAGE_BITS or self.embed_groups < 0 or
                                self.embed_groups and self.dim % self.embed_groups or
                                self.embed_scale not in PARAM_DTYPES or self.embed_zero not in ("", *PARAM_DTYPES)):
            raise ValueError(f"invalid token table for the glue: bits {self.embed_bits}, {self.embed_groups} groups "
                             f"a row, scales {self.embed_scale!r}, zeros {self.embed_zero!r}")

    @property
    def name(self) -> str:
        return (f"glue_{self.isa}_d{self.dim}_h{self.n_heads}x{self.n_kv_heads}x{self.head_dim}_f{self.ffn_dim}"
                f"_{self.act}{'_subnorms' if self.sub_norms else ''}{'_aq' if self.act_quant else ''}"
                f"{'_kvh' if self.kv_dtype == 'float16' else ''}{self._embed_suffix}{self._attention_suffix}")

    @property
    def _attention_suffix(self) -> str:
        return "".join(_tag(f.metadata["tag"], f.default, getattr(self, f.name)) for f in VARIATIONS)

    @property
    def attend_args(self) -> tuple[str, ...]:
        """The names of ``attend``'s arguments, in order."""
        return self._attend_args(batched=False)

    @property
    def attend_rows_args(self) -> tuple[str, ...]:
        """The names of ``attend_rows``'s arguments, in order: ``attend``'s and ``last`` after ``pos``."""
        return self._attend_args(batched=True)

    def _attend_args(self, batched: bool) -> tuple[str, ...]:
        return ("qkv", *self.qkv_bias * ("bias",), *self.qk_norm * ("q_norm", "k_norm", "eps"), "cos", "sin",
                "cache_k", "cache_v", "scores", "pos", *batched * ("last",), *self.window * ("window",), "out")

    @property
    def _embed_suffix(self) -> str:
        if self.embed_blocks:
            return f"_e{self.embed_blocks.lower()}"
        if not self.embed_bits:
            return ""
        half = {"float16": "h", "float32": "f"}
        return (f"_e{self.embed_bits}g{self.embed_groups}{half[self.embed_scale]}"
                + (f"z{half[self.embed_zero]}" if self.embed_zero else ""))

    @property
    def row_functions(self) -> tuple[str, ...]:
        """The functions of one row that also come batched: ``NAME_rows``, the same over every row of its
        ``[rows, n]`` buffers, the rows on the thread pool (a prefill's)."""
        return ("norm_in" if self.pre_norms else "add_in", "gated_act", *self.sub_norms * ("norm_attn", "norm_hidden"),
                *self.post_norms * ("norm_post_attn", "norm_post_ffn"),
                *self.act_quant * ("quantize_dim", "quantize_q", "quantize_ffn"))

    @property
    def functions(self) -> tuple[str, ...]:
        return (*self.row_functions, *(name + ROWS for name in self.row_functions), "norm_final", "attend",
                "attend" + ROWS, *self.qk_norm_whole * ("norm_q", "norm_k"),
                *bool(self.embed_bits or self.embed_blocks) * ("embed",))

    def to_dict(self) -> dict:
        return asdict(self)


VARIATIONS = tuple(f for f in fields(GlueSpec) if "tag" in f.metadata)
