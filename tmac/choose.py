"""Which ``KernelSpec`` serves weights of a format with K inputs on an ISA: explicit arguments first, then what
``tmac tune`` measured on this machine (``tuning.json`` in the kernel cache; this module is its only reader), then
the defaults the spec derives from the ISA's facts."""

from __future__ import annotations

import functools
import json
import os
import warnings

from .files import read_json
from .formats import PER_ROW, PER_TENSOR, WeightFormat
from .kquant import factor_params
from .qweight import QuantizedWeight, all_float16
from .reference import TRIPLE_LUT_GROUP, default_lut_group, padded_k
from .spec import QUAD_CHUNKS, KernelSpec, quad_step


def spec_for(qw: QuantizedWeight, isa, **tiling) -> KernelSpec:
    """The kernel spec that serves ``qw`` on ``isa`` (a ``tmac.kernels.Isa``): with super scales where its format
    has them and its parameters factor (else plain float32 ones)."""
    return spec_and_factors(qw, isa, tiling)[0]


def spec_and_factors(qw: QuantizedWeight, isa, tiling: dict):
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


TILE_FIELDS = ("block_rows", "unroll", "n_tile", "k_chunk")  # k_chunk may be missing: tuned before K chunks


def tuning_file() -> str:
    from .cache import cache_dir

    return os.path.join(cache_dir(), "tuning.json")


def key(isa: str, bits: int, k: int, group: int, lut_group: int, has_zeros: bool, triples: bool = False) -> str:
    return f"{isa}|b{bits}|k{k}|g{group}|lg{lut_group}|{'z' if has_zeros else 's'}" + ("|t3" if triples else "")


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
                 triples: bool = False) -> dict:
    """The persisted tiling for these kernel parameters ({} when never tuned, or the cache is unreadable)."""
    try:
        path = tuning_file()
    except Exception:  # no apache-tvm installed: no cache, no tuning
        return {}
    return dict(_table(path).get(key(isa, bits, k, group, lut_group, has_zeros, triples), {}))


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
