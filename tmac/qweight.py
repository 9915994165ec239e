"""``QuantizedWeight``: unpacked codes plus group scales/zeros in one of the formats of ``tmac.formats``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .formats import PER_TENSOR, WeightFormat


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight matrix ``[M, K]`` (out_features × in_features) as codes and group parameters.

    ``codes`` is uint8 ``[M, K]``; ``scales`` (and ``zeros`` when the format has them) are float32 or float64
    ``format.scale_shape(M, K)``. Float64 is kept where an importer needs it to be exact (GGUF Q4_1's zero
    ``−(m + 8d)`` is not always representable in float32); kernels use float32 copies.
    """

    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None
    format: WeightFormat

    def __post_init__(self):
        codes, fmt = self.codes, self.format
        if not isinstance(codes, np.ndarray) or codes.dtype != np.uint8 or codes.ndim != 2:
            raise TypeError(f"codes must be a 2-D uint8 numpy array, got {_describe(codes)}")
        m, k = codes.shape
        fmt.groups_per_row(k)  # raises when the group size does not divide K
        lo, hi = fmt.code_range
        if codes.size and (int(codes.min()) < lo or int(codes.max()) > hi):
            raise ValueError(f"codes of format {fmt.name} must lie in [{lo}, {hi}], got [{codes.min()}, {codes.max()}]")
        _check_params("scales", self.scales, fmt.scale_shape(m, k), fmt.scale_dtype)
        if fmt.has_zeros:
            if self.zeros is None:
                raise ValueError(f"format {fmt.name} needs zeros, got None")
            _check_params("zeros", self.zeros, fmt.scale_shape(m, k), fmt.zero_dtype)
        elif self.zeros is not None:
            raise ValueError(f"format {fmt.name} has no zeros, but zeros were given")

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def expanded(self, params: np.ndarray) -> np.ndarray:
        """Group parameters repeated to one value per weight, ``[M, K]`` (float64)."""
        m, k = self.shape
        p = params.astype(np.float64)
        if self.format.group_size == PER_TENSOR:
            return np.broadcast_to(p, (m, k))
        return np.repeat(p, k // p.shape[1], axis=1)

    def dequantize(self) -> np.ndarray:
        """Float32 ``[M, K]``: ``s·(q − offset) − z``, evaluated exactly in float64 and rounded once."""
        w = self.expanded(self.scales) * (self.codes.astype(np.float64) - self.format.offset)
        if self.zeros is not None:
            w = w - self.expanded(self.zeros)
        return w.astype(np.float32)


def stack_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight holding the rows of ``parts`` in order (fused projections). Parts must share bits, zeros,
    K and group size; per-tensor scales become per-row ones so that each part keeps its own."""
    def kind(p):
        g = p.format.group_size
        return p.format.bits, p.format.has_zeros, p.format.ternary, p.shape[1], g if isinstance(g, int) else "whole row"

    if not parts or len({kind(p) for p in parts}) != 1:
        raise ValueError(f"cannot stack weights of formats {[p.format.name for p in parts]} with K "
                         f"{[p.shape[1] for p in parts]}")
    if len(parts) == 1:  # nothing to stack: no copy of the codes (a 49152-row head's are 100 MB)
        return parts[0]
    fmt = parts[0].format
    if not isinstance(fmt.group_size, int) and (fmt.group_size == PER_TENSOR or any(p.format != fmt for p in parts)):
        fmt = fmt.per_row()
    for field in ("scale_dtype", "zero_dtype"):  # float16 only where every part promises it
        if any(getattr(p.format, field) != getattr(fmt, field) for p in parts):
            fmt = dataclasses.replace(fmt, name=f"{fmt.name}_f32", gguf=None, **{field: "float32"})

    def per_row(p, params):
        return np.broadcast_to(params, (p.shape[0], 1)) if p.format.group_size != fmt.group_size else params

    scales = np.concatenate([per_row(p, p.scales).astype(np.float64) for p in parts])
    zeros = None if fmt.has_zeros is False else np.concatenate([per_row(p, p.zeros).astype(np.float64) for p in parts])
    return QuantizedWeight(np.concatenate([p.codes for p in parts]), scales, zeros, fmt)


def _check_params(name: str, a, shape: tuple[int, int], storage: str) -> None:
    if not isinstance(a, np.ndarray) or a.dtype not in (np.float16, np.float32, np.float64):
        raise TypeError(f"{name} must be a float16/float32/float64 numpy array, got {_describe(a)}")
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError(f"{name} contain NaN or inf")
    if storage == "float16" and not all_float16(a):
        raise ValueError(f"{name} are not all exactly float16 values, as their format promises")


def all_float16(a: np.ndarray) -> bool:
    """Whether every value of the float array ``a`` is exactly a float16 value (what float16 storage needs)."""
    if a.dtype == np.float16:
        return True
    with np.errstate(over="ignore"):
        return bool(np.array_equal(a.astype(np.float16).astype(a.dtype), a))


def _describe(a) -> str:
    if isinstance(a, np.ndarray):
        return f"ndarray(dtype={a.dtype}, shape={a.shape})"
    return type(a).__name__
