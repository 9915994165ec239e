"""``QuantizedWeight``: unpacked codes plus group scales/zeros in one of the formats of ``tmac.base.formats``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np

from tmac.base.formats import PER_TENSOR, WeightFormat


class RowCodes:
    """Codes ``[M, K]`` decoded a row slice at a time from a file's blocks, for a matrix too large to hold
    unpacked at once (a vocabulary table: 100 MB at a byte a code, beside 25 MB packed). ``codes[r0:r1]`` decodes
    those rows; anything else (``np.asarray``, an index array) decodes the whole."""

    dtype = np.dtype(np.uint8)
    ndim = 2
    SLICE = 1 << 22  # codes decoded at a time where the whole is asked for

    def __init__(self, shape: tuple[int, int], rows: Callable[[int, int], np.ndarray], blocks: np.ndarray | None = None,
                 type_name: str = ""):
        self.shape, self._rows = tuple(shape), rows
        # the file's blocks ``[M, row bytes]`` of GGUF type ``type_name``, where a reader of raw rows wants them
        self.blocks, self.type_name = blocks, type_name

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        if isinstance(key, slice) and key.step in (None, 1):
            r0, r1, _ = key.indices(self.shape[0])
            return self._rows(r0, max(r0, r1))
        return np.asarray(self)[key]

    def __array__(self, dtype=None, copy=None):
        out = np.empty(self.shape, np.uint8)
        step = max(1, self.SLICE // max(1, self.shape[1]))
        for r0 in range(0, self.shape[0], step):
            out[r0:r0 + step] = self._rows(r0, min(self.shape[0], r0 + step))
        return out if dtype is None else out.astype(dtype)

    def astype(self, dtype) -> np.ndarray:
        return np.asarray(self).astype(dtype)


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight matrix ``[M, K]`` (out_features × in_features) as codes and group parameters.

    ``codes`` is uint8 ``[M, K]`` (or ``RowCodes``, whose decoder keeps them in range); ``scales`` (and ``zeros`` when the format has them) are float32 or float64
    ``format.scale_shape(M, K)``. Float64 is kept where an importer needs it to be exact (GGUF Q4_1's zero
    ``−(m + 8d)`` is not always representable in float32); kernels use float32 copies.
    """

    codes: np.ndarray | RowCodes
    scales: np.ndarray
    zeros: np.ndarray | None
    format: WeightFormat
    # llama.cpp K-quants' parameters as their file stores them, where an importer read them: what
    # ``tmac.quant.kquant.factor_params`` would find, ``((a, d), (b, m) or None)`` with scales d·a and zeros
    # m·b − offset·d·a exactly (the importer checks); factoring the floats again costs a first load seconds
    factors: tuple | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        codes, fmt = self.codes, self.format
        streamed = isinstance(codes, RowCodes)
        if not streamed and (not isinstance(codes, np.ndarray) or codes.dtype != np.uint8 or codes.ndim != 2):
            raise TypeError(f"codes must be a 2-D uint8 numpy array, got {_describe(codes)}")
        m, k = codes.shape
        fmt.groups_per_row(k)  # raises when the group size does not divide K
        lo, hi = fmt.code_range
        if not streamed and codes.size and (int(codes.min()) < lo or int(codes.max()) > hi):
            raise ValueError(f"codes of format {fmt.name} must lie in [{lo}, {hi}], got [{codes.min()}, {codes.max()}]")
        _check_params("scales", self.scales, fmt.scale_shape(m, k), fmt.scale_dtype)
        if fmt.has_zeros:
            if self.zeros is None:
                raise ValueError(f"format {fmt.name} needs zeros, got None")
            _check_params("zeros", self.zeros, fmt.scale_shape(m, k), fmt.zero_dtype)
        elif self.zeros is not None:
            raise ValueError(f"format {fmt.name} has no zeros, but zeros were given")
        if self.factors is not None:
            (a, d), zero = self.factors
            sg = fmt.groups_per_super
            if not sg or a.shape != self.scales.shape or d.shape != (m, a.shape[1] // sg) or \
                    (zero is None) == fmt.has_zeros or (zero is not None and zero[0].shape != a.shape):
                raise ValueError(f"factors of format {fmt.name} do not fit scales of shape {self.scales.shape}")

    def take_rows(self, order: np.ndarray) -> QuantizedWeight:
        """The weight with rows ``order`` (an index array) of this one, parameters and factors with them."""
        per_row = self.scales.shape[0] == self.shape[0]
        factors = None if self.factors is None else \
            tuple(None if f is None else (f[0][order], f[1][order]) for f in self.factors)
        return QuantizedWeight(self.codes[order], self.scales[order] if per_row else self.scales,
                               None if self.zeros is None else self.zeros[order], self.format, factors)

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
        """Float32 ``[M, K]``: ``s·(q − offset) − z`` (``s·level[q]``: codebooks), evaluated exactly in float64 and
        rounded once."""
        w = self.expanded(self.scales) * self.format.levels(np.asarray(self.codes))
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
    factors = None
    if all(p.factors is not None for p in parts):
        factors = tuple(None if parts[0].factors[i] is None else
                        tuple(np.concatenate([p.factors[i][j] for p in parts]) for j in (0, 1)) for i in (0, 1))
    return QuantizedWeight(_stacked_codes(parts), scales, zeros, fmt, factors)


def _stacked_codes(parts: list[QuantizedWeight]) -> np.ndarray | RowCodes:
    """The parts' codes one after another: an array for small parts, else ``RowCodes`` reading each part's rows
    where they are asked for (no copy of a fused gate|up's codes, 32 MB at a 1B model's shape)."""
    if sum(p.codes.size for p in parts) < STACK_COPY:
        return np.concatenate([np.asarray(p.codes) for p in parts])
    starts = np.cumsum([0] + [p.shape[0] for p in parts])

    def rows(r0: int, r1: int) -> np.ndarray:
        pieces = [p.codes[max(r0 - a, 0):min(r1, b) - a] for p, a, b in zip(parts, starts, starts[1:])
                  if a < r1 and r0 < b]
        return np.concatenate([np.asarray(x) for x in pieces]) if len(pieces) != 1 else np.asarray(pieces[0])

    return RowCodes((int(starts[-1]), parts[0].shape[1]), rows)


STACK_COPY = 1 << 20  # codes of parts below which stacking copies them


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
