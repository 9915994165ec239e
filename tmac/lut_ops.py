"""``LutWeight``: packed weights as torch tensors plus their kernels, and the one checked path into them.

Every argument is validated here (type, dtype, device, shape, contiguity) before a pointer reaches compiled
code; the kernels additionally check shapes and dtypes themselves, and declare every buffer unaligned, so a
torch view or numpy slice can never fault on alignment.
"""

from __future__ import annotations

import threading

import torch

from . import runtime
from .kernels import best_isa, isa_by_name
from .packing import KernelSpec, PackedWeight, pack, spec_for
from .qweight import QuantizedWeight

_workspaces = threading.local()


class LutWeight:
    """A weight ``[M, K]`` ready for the LUT kernels of one ISA."""

    def __init__(self, packed: PackedWeight, kernel_dir: str | None = None):
        self.spec: KernelSpec = packed.spec
        self.m = packed.m
        self.k = packed.spec.k
        self.weights = torch.from_numpy(packed.weights)
        self.scales = torch.from_numpy(packed.scales)
        self.zeros = None if packed.zeros is None else torch.from_numpy(packed.zeros)
        self.kernel_dir = kernel_dir
        self._kernels = None

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, isa: str | None = None, kernel_dir: str | None = None,
                       **tiling) -> "LutWeight":
        target = isa_by_name(isa) if isa else best_isa()
        return cls(pack(qw, spec_for(qw, target, **tiling)), kernel_dir)

    @property
    def kernels(self) -> runtime.KernelLibrary:
        if self._kernels is None:
            self._kernels = runtime.load_kernels(self.spec, isa_by_name(self.spec.isa), self.kernel_dir)
        return self._kernels

    def tensors(self) -> list[torch.Tensor]:
        return [self.weights, self.scales] + ([self.zeros] if self.zeros is not None else [])

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T`` for float32 ``x [N, K]``; returns float32 ``[N, M]``."""
        check_activations(x, self.k)
        n = x.shape[0]
        if out is None:
            out = torch.empty((n, self.m), dtype=torch.float32)
        elif out.dtype != torch.float32 or tuple(out.shape) != (n, self.m) or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous float32 tensor of shape {(n, self.m)}, got "
                             f"{out.dtype} {tuple(out.shape)}")
        if n == 0:
            return out
        kernels = self.kernels
        runtime.apply_threads()
        gemv = n == 1
        rows = 1 if gemv else self.spec.padded_rows(n)
        lut, ls, xs = _workspace(self.spec, rows)
        kernels.build_tables(x, lut, ls, xs)
        (kernels.lut_gemv if gemv else kernels.lut_gemm)(*self.tensors(), lut, ls, xs, out)
        return out


def check_activations(x, k: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"activations must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"activations must be float32, got {x.dtype}")
    if x.device.type != "cpu":
        raise ValueError(f"activations must be on the CPU, got device {x.device}")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"activations must have shape [N, {k}], got {list(x.shape)}")
    if not x.is_contiguous():
        raise ValueError("activations must be contiguous")


def _workspace(spec: KernelSpec, rows: int):
    """Per-thread table buffers, reused across calls (no allocation per token)."""
    cache = getattr(_workspaces, "buffers", None)
    if cache is None:
        cache = _workspaces.buffers = {}
    key = (spec.k, spec.lut_group, spec.group_size, rows)
    bufs = cache.get(key)
    if bufs is None:
        bufs = (torch.empty((rows, spec.k // 4, 16), dtype=torch.int8),
                torch.empty((rows, spec.k // spec.lut_group), dtype=torch.float32),
                torch.empty((rows, spec.k // spec.group_size), dtype=torch.float32))
        cache[key] = bufs
    return bufs


