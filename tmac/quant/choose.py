"""Which ``KernelSpec`` serves weights of a format with K inputs on an ISA: explicit arguments first, then what
``tmac tune`` measured on this machine (``tuning.json`` in the kernel cache; this module is its only reader), then
the defaults the spec derives from the ISA's facts."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings

import numpy as np

from tmac.base.files import read_json
from tmac.base.formats import PER_ROW, PER_TENSOR, WeightFormat
from tmac.quant.held import held_format
from tmac.quant.kquant import factor_params
from tmac.base.qweight import QuantizedWeight, all_float16
from tmac.base.reference import TRIPLE_LUT_GROUP, default_lut_group, padded_k
from tmac.quant.layout import GRID_TYPES, QUAD_CHUNKS, quad_step
from tmac.quant.spec import MAX_SUPER_EXPONENT, KernelSpec, packed_shapes


def spec_for(qw: QuantizedWeight, isa, **tiling) -> KernelSpec:
    """The kernel spec that serves ``qw`` on ``isa`` (a ``tmac.kernels.Isa``): with super scales where its format
    has them and its parameters factor (else plain float32 ones)."""
    return spec_and_factors(qw, isa, tiling)[0]


def spec_and_factors(qw: QuantizedWeight, isa, tiling: dict):
    """The spec for ``qw``, and the factors of its parameters where that spec streams them (else None)."""
    fmt = qw.format
    factors = None
    if fmt.super_group is not None and tiling.get("super_groups") != 0:
        factors = factor_params(qw, tiling.get("super_groups"))
        if factors is None:  # plain float32 parameters
            tiling = {**tiling, "super_groups": 0}
        elif "super_dtype" not in tiling:
            if "super_exponent" in tiling:
                dtype, exponent = super_dtype(factors, tiling["super_exponent"]), tiling["super_exponent"]
            else:
                dtype, exponent = super_storage(factors)
            tiling = {**tiling, "super_dtype": dtype, "super_exponent": exponent}
    return fitting_block_rows(spec_for_format(fmt, qw.shape[1], isa, **tiling), qw.shape[0], fmt, isa, tiling), factors


def fitting_block_rows(spec: KernelSpec, rows: int, fmt: WeightFormat, isa, tiling: dict) -> KernelSpec:
    """``spec``, or where its blocks do not divide the ``rows`` of a matrix, the same with the largest halving of
    its block rows that does: padded rows are streamed, computed and stored like real ones (a 960-row projection in
    blocks of 128 is 7 % padding; docs/decisions.md, "Block rows"). Block rows given explicitly are kept."""
    if "block_rows" in tiling or rows % spec.block_rows == 0:
        return spec
    half = spec.block_rows // 2
    while half >= isa.vector_bytes and half % isa.vector_bytes == 0:
        if rows % half == 0:
            try:
                return spec_for_format(fmt, spec.k, isa, **{**tiling, "block_rows": half})
            except ValueError:
                return spec
        half //= 2
    return spec


def super_dtype(factors, exponent: int = 0) -> str:
    """Storage of the super scales of ``factor_params``' factors times 2^``exponent``: float16 where every one is a
    float16 value (a K-quant import's always are: llama.cpp's d and dmin), else float32."""
    bases = [f[1] for f in factors if f is not None]
    return "float16" if all(all_float16(np.ldexp(b, exponent)) for b in bases) else "float32"


def super_storage(factors) -> tuple[str, int]:
    """``super_dtype`` and exponent of the super scales: float16 times the least power of two that makes every one a
    float16 value (llama.cpp's d over a power of two can fall below float16's normal range: IQ2's d/8), else
    float32 as they are."""
    for exponent in range(MAX_SUPER_EXPONENT + 1):
        if super_dtype(factors, exponent) == "float16":
            return "float16", exponent
    return "float32", 0


def spec_for_format(fmt: WeightFormat, k: int, isa, **tiling) -> KernelSpec:
    """The kernel spec for weights of format ``fmt`` with ``k`` inputs on ``isa``; tiling not given explicitly
    comes from ``tmac tune``'s results for these parameters, else the defaults."""
    fmt = held_format(fmt, isa, tiling.get("grid"), tiling.get("super_groups"))  # (IQ1_S's grid: codebook codes)
    group = k if fmt.group_size in (PER_ROW, PER_TENSOR) else fmt.group_size
    params = dict(scale_dtype=fmt.scale_dtype, zero_dtype=fmt.zero_dtype if fmt.has_zeros else "float32")
    supers = tiling.pop("super_groups", fmt.groups_per_super)
    halves = tiling.pop("super_dtype", "float16")  # (a K-quant file's own)
    exponent = tiling.pop("super_exponent", 0)
    if supers:
        params.update(super_groups=supers, scale_dtype=halves, zero_dtype=halves if fmt.has_zeros else "float32",
                      super_exponent=exponent if halves == "float16" else 0)
    if fmt.codebook is not None:  # one activation a table, in bit-plane bytes (tmac.quant.layout.CodebookCodes)
        params["codebook"] = fmt.codebook
    triples = tiling.pop("triples", uses_triples(fmt, k, isa))
    lut_group = TRIPLE_LUT_GROUP if triples else default_lut_group(k, fmt.group_size)
    # (a quad step covers 32 activations but at 2 bits: 3-bit weights in groups of 16, Q3_K's, take bit planes;
    # codebook codes are one plane, of 8 activations a step — a row's four bytes, one table each nibble — so groups
    # of 16 take quads too: vpdpbusd sums a row's four lookups with unit weights)
    planes = 1 if fmt.codebook is not None else fmt.bits
    step = 8 if fmt.codebook is not None else quad_step(planes) if planes in QUAD_CHUNKS else 0
    if tiling.pop("quads", isa.wide_lookup and (triples or step and lut_group % step == 0)):
        params["quads"] = True
    # a grid i-quant's quads are held as its indices and sign bits where the kernels expand them (its own size)
    own = fmt.codebook is not None and fmt.gguf is not None and fmt.gguf.type_name in GRID_TYPES and isa.expands_grids
    grid = tiling.pop("grid", fmt.gguf.type_name if own else "")
    if grid and params.get("quads"):
        params["grid"] = grid
    if triples:  # 1.67 instead of 2 bits streamed per weight
        fixed, params = (2, k, k, TRIPLE_LUT_GROUP, False), {**params, "triples": True}
    else:
        fixed = (fmt.bits, k, group, lut_group, fmt.has_zeros)
    if tiling:
        return tiled(isa, fixed, params, tiling)
    tuned = tuned_tiling(isa.name, *fixed, triples=triples, codebook=fmt.codebook is not None)
    try:
        return tiled(isa, fixed, params, tuned)
    except ValueError as e:  # a tuning table edited or damaged by hand: the defaults, not an error on every layer
        if tuned:
            warnings.warn(f"tuning.json: ignoring the tiling {tuned} for {isa.name} W{fixed[0]} K={k} ({e})",
                          stacklevel=2)
            return tiled(isa, fixed, params, {})
        raise


def uses_triples(fmt: WeightFormat, k: int, isa) -> bool:
    """Ternary weights with one scale per row or tensor are packed as triples by default on ISAs with 64-entry
    lookups (quads), unless padding K to whole lut groups costs more than the triples save (small K). Elsewhere
    the triples' negation (a mask spread over the lanes, or a k-register load and a masked subtract, per lookup)
    costs more than their 17 % fewer bytes save (docs/decisions.md, "Triples")."""
    return fmt.ternary and fmt.group_size in (PER_ROW, PER_TENSOR) and isa.wide_lookup and padded_k(k) * 5 < k * 6


TILE_FIELDS = ("block_rows", "unroll", "n_tile", "k_chunk")  # k_chunk may be missing: tuned before K chunks


def tuning_file() -> str:
    from tmac.quant.cache import cache_dir

    return os.path.join(cache_dir(), "tuning.json")


def key(isa: str, bits: int, k: int, group: int, lut_group: int, has_zeros: bool, triples: bool = False,
        codebook: bool = False) -> str:
    return f"{isa}|b{bits}|k{k}|g{group}|lg{lut_group}|{'z' if has_zeros else 's'}" + ("|t3" if triples else "") + \
        ("|cb" if codebook else "")


@functools.lru_cache(maxsize=1)
def _table(path: str) -> dict:
    try:
        table = read_json(path, 16 << 20)
    except (OSError, ValueError):  # missing, or not a tuning table (a FIFO, a device, malformed): never tuned
        return {}
    if not isinstance(table, dict):
        return {}
    return {k: v for k, v in table.items() if isinstance(v, dict) and set(TILE_FIELDS[:3]) <= set(v) <= set(TILE_FIELDS)
            and all(type(x) is int and x > 0 for x in v.values())}


def tuned_tiling(isa: str, bits: int, k: int, group: int, lut_group: int, has_zeros: bool,
                 triples: bool = False, codebook: bool = False) -> dict:
    """The persisted tiling for these kernel parameters ({} when never tuned, or the cache is unreadable)."""
    try:
        path = tuning_file()
    except Exception:  # no apache-tvm installed: no cache, no tuning
        return {}
    return dict(_table(path).get(key(isa, bits, k, group, lut_group, has_zeros, triples, codebook), {}))


def save_tiling(entry_key: str, tiling: dict) -> None:
    """Record ``tmac tune``'s choice for the kernel parameters ``entry_key`` (``key``)."""
    path = tuning_file()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    table = dict(_table(path))
    table[entry_key] = tiling
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    _table.cache_clear()


# a K chunk's tables + one block's weights of it: half of a 32 KiB L1 (``_default_k_chunk``)
CHUNK_BYTES = 16 << 10


def tiled(isa, fixed: tuple, params: dict, tiling: dict) -> KernelSpec:
    """The spec of the fixed fields ``(bits, k, group_size, lut_group, has_zeros)`` and ``params`` on ``isa``, with
    ``tiling`` where it says (a field missing or 0: its default, chosen from the ISA's facts: ``Isa.vector_registers``
    and the vector width; docs/decisions.md, "Kernel tiling")."""
    given = {f: v for f, v in tiling.items() if v != 0}
    k = fixed[1]
    # the spec's derived sizes (row bytes, steps, chunk unit) do not depend on the tiling: a valid placeholder one
    # gives them, and refuses fixed fields no tiling makes valid
    probe = KernelSpec(isa.name, *fixed, block_rows=isa.vector_bytes, n_tile=2, unroll=1,
                       k_chunk=padded_k(k) if params.get("triples") else k, **params)
    sixteen_registers = isa.vector_registers == 16
    rows = given.get("block_rows") or _default_block_rows(probe, sixteen_registers)
    chosen = {"block_rows": rows, "n_tile": given.get("n_tile") or (4 if sixteen_registers and probe.bits == 1 else 2),
              "unroll": given.get("unroll") or _default_unroll(probe, rows, isa)}
    chosen["k_chunk"] = given.get("k_chunk") or _default_k_chunk(dataclasses.replace(probe, block_rows=rows))
    return KernelSpec(isa.name, *fixed, **{**given, **chosen}, **params)


def _default_block_rows(spec: KernelSpec, sixteen_registers: bool) -> int:
    """About four vectors of weights per block: enough independent accumulator chains to hide latency. Blocks of
    4 weight vectors a step (W4, 1- and 2-bit quads) and 5-bit quads on 64-byte vectors take twice the rows
    (docs/decisions.md, "Block rows"); with 16 registers (AVX2, SSE2) a one-plane vector's sums (W1; triples, where
    asked for without quads) are int16 of a vector's rows, two registers, so such blocks take half the rows."""
    vl, row_bytes = spec.vector_bytes, spec.layout.row_bytes
    rows = vl * max(1, 4 // row_bytes)
    wider = 2 if vl == 64 and row_bytes == 4 and not spec.triples and \
        (spec.step_vectors(rows) == 4 or spec.quads and spec.bits == 5) else 1
    narrower = 2 if sixteen_registers and spec.layout.chunks == ((0, 1),) else 1
    rows = wider * rows // narrower
    if vl == 16 and spec.super_groups and spec.has_zeros:
        # K-quants with mins sum two floats a row over a super group (codegen/lut.py): 32 rows' were 16 of NEON's
        # registers and spilled (Q2_K, docs/decisions.md "NEON's tilings by instruction counts")
        rows = min(rows, 16)
    if vl == 16 and spec.codebook:  # codebook codes, one byte a row a step: blocks of 64 rows took a sixth more
        rows = min(rows, 32)  # instructions on NEON (the same place)
    return rows


def _default_unroll(spec: KernelSpec, block_rows: int, isa) -> int:
    """Up to 8 table pairs per unrolled body, and as many weight vectors as ``Isa.unroll_fits`` (32; NEON's pair
    sums 12); with 16 registers a lut group of 4 or more steps is not unrolled whole: the body and the epilogue
    would share one basic block, whose schedule spills (docs/decisions.md, "Unroll" and "NEON's pair sums")."""
    steps = spec.steps_per_lut_group
    sixteen_registers = isa.vector_registers == 16
    chunks = spec.layout.chunks
    # each chunk's weight vectors a step: (planes, vectors); quads and triples as one
    per_step = [(planes, block_rows * planes / spec.vector_bytes) for _, planes in chunks] if chunks else \
        [(spec.layout.codes.planes, spec.step_vectors(block_rows))]
    fits = [u for u in spec.unrolls() if isa.unroll_fits([(p, u * v) for p, v in per_step]) and
            not (sixteen_registers and u == steps and steps >= 4)]
    return fits[0] if fits else 1


def _default_k_chunk(spec: KernelSpec) -> int:
    """Triples, 1-bit weights and 16-byte vectors: the most activations whose tables and one block's weights of
    them fit ``CHUNK_BYTES``, in chunks of near-equal size: streaming a block's weights through L1 evicted its
    tables before the next block reused them. On 64-byte vectors 2-5 bits (fewer table bytes per weight byte) and
    codebook codes (their chunks slowed the GEMM of a prompt) gain nothing: one chunk; so does AVX2, whose GEMV
    prefetches its weights (docs/decisions.md, "K chunks")."""
    unit, kp = spec.chunk_unit, spec.k_padded
    chunked = spec.vector_bytes == 16 or spec.vector_bytes == 64 and spec.layout.codes.planes == 1 and \
        not spec.codebook  # W1, triples
    if not chunked or unit <= 0 or kp % unit:
        return kp
    w_shape, s_shape = packed_shapes(spec, spec.block_rows)
    per_activation = (np.prod(w_shape) + 2 * np.prod(s_shape)) / kp + 16 / spec.layout.codes.per_table
    units = kp // unit
    fit = max(1, min(units, int(CHUNK_BYTES // (per_activation * unit))))
    chunks = -(-units // fit)
    return -(-units // chunks) * unit
