"""The one checked path into the compiled LUT kernels, and ``LutWeight``, packed weights as torch tensors.

Every argument is validated here (type, dtype, device, shape, contiguity) before a pointer reaches compiled
code; the kernels additionally check shapes and dtypes themselves, and declare every buffer unaligned, so a
torch view or numpy slice can never fault on alignment.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

from tmac.execution import runtime
from tmac.base.reference import QUANT_BLOCK
from tmac.kernels import ISAS, best_isa, isa_by_name
from tmac.execution.packing import PackedWeight, pack_for
from tmac.quant.spec import KernelSpec, packed_shapes
from tmac.base.qweight import QuantizedWeight

_workspaces = threading.local()
_libraries: dict[tuple[KernelSpec, str | None], runtime.KernelLibrary] = {}


def kernels_for(spec: KernelSpec, kernel_dir: str | None = None) -> runtime.KernelLibrary:
    lib = _libraries.get((spec, kernel_dir))
    if lib is None:
        lib = _libraries[(spec, kernel_dir)] = runtime.load_kernels(spec, isa_by_name(spec.isa), kernel_dir)
    return lib


def lut_linear(x: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               bias: torch.Tensor | None, spec: KernelSpec, m: int, kernel_dir: str | None = None,
               out: torch.Tensor | None = None, bound: tuple | None = None, checked: bool = False) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for float32 ``x [N, K]`` and packed ``W`` of ``m`` rows; float32 ``[N, m]``.
    ``bound``: what ``bind_packed`` returned for exactly these packed tensors, spec and kernel directory;
    ``checked``: the caller has made ``x`` what ``check_activations`` requires (``tmac.Linear`` does)."""
    if not checked:
        check_activations(x, spec.k)
    if bound is None:
        check_packed(spec, m, weights, scales, zeros, bias)
        params = (weights, scales) if zeros is None else (weights, scales, zeros)
        kernels = kernels_for(spec, kernel_dir)
    else:
        params, kernels = bound
    n = x.shape[0]
    if out is None:
        out = torch.empty((n, m), dtype=torch.float32)
    elif not isinstance(out, torch.Tensor) or out.layout != torch.strided or out.device.type != "cpu" or \
            out.is_neg() or out.is_conj():
        raise TypeError(f"out must be a dense CPU tensor, got {getattr(out, 'layout', type(out).__name__)} on "
                        f"{getattr(out, 'device', '-')}")
    elif out.dtype != torch.float32 or tuple(out.shape) != (n, m) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 tensor of shape {(n, m)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if n == 0:
        return out
    runtime.apply_threads()
    if takes_dot_products(spec, n, prefill=getattr(_prompt, "on", False)):
        _, bufs = _workspace(spec, dot_padded_rows(spec, n), dot=True)
        kernels.quantize_rows(x, *bufs)
        kernels.dot_gemm(*params, *bufs, out)
        if bias is not None:
            out.add_(bias)
        return out
    gemv = n == 1
    _, tables = _workspace(spec, 1 if gemv else spec.padded_rows(n))
    if gemv:
        kernels.lut_gemv(x, *params, *tables, out)
    else:
        kernels.build_tables(x, *tables)
        kernels.lut_gemm(*params, *tables, out)
    if bias is not None:
        out.add_(bias)
    return out


def check_activations(x, k: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"activations must be a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided or x.is_nested:
        raise TypeError(f"activations must be a dense (strided) tensor, got layout {x.layout}"
                        + (" (nested)" if x.is_nested else ""))
    if x.is_neg() or x.is_conj():  # a lazy negation or conjugation the kernel's raw pointer would not see
        raise ValueError("activations are a lazily negated/conjugated view: call .resolve_neg()/.resolve_conj()")
    if x.dtype != torch.float32:
        raise TypeError(f"activations must be float32, got {x.dtype}")
    if x.device.type != "cpu":
        raise ValueError(f"activations must be on the CPU, got device {x.device}")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"activations must have shape [N, {k}], got {list(x.shape)}")
    if not x.is_contiguous():
        raise ValueError("activations must be contiguous")


def check_packed(spec: KernelSpec, m, weights, scales, zeros, bias) -> None:
    """Packed tensors must be exactly what ``spec`` reads for ``m`` rows: a kernel trusts these shapes."""
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"out_features must be a positive int, got {m!r}")
    w_shape, s_shape = packed_shapes(spec, m)
    expected = [("weights", weights, torch.uint8, w_shape), ("scales", scales, getattr(torch, spec.param_dtypes[0]), s_shape)]
    if spec.has_zeros:
        expected.append(("zeros", zeros, getattr(torch, spec.param_dtypes[1]), s_shape))
    elif zeros is not None:
        raise ValueError(f"kernel {spec.name} takes no zeros, but zeros were given")
    if bias is not None:
        expected.append(("bias", bias, torch.float32, (m,)))
    for name, t, dtype, shape in expected:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"packed {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype or tuple(t.shape) != shape or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"packed {name} must be a contiguous CPU {dtype} tensor of shape {shape} for "
                             f"kernel {spec.name} with {m} rows, got {t.dtype} {tuple(t.shape)} on {t.device}"
                             + ("" if t.is_contiguous() else " (non-contiguous)"))


class _Binding(tuple):
    """(packed tensors, their sizes, spec, kernel directory, (views, library)): what ``bind_packed`` remembers in its
    owner's ``__dict__``. It holds views of the owner's tensors, so a copy or a pickle of the owner gets none."""

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return type(None), ()


def bind_packed(owner, spec: KernelSpec, m: int, packed: tuple, kernel_dir: str | None) -> tuple:
    """(the kernels' views of W, S[, Z], the kernel library) for ``packed`` = (W, S, Z, bias), after
    ``check_packed``; remembered for ``owner`` and reused while it calls with the very same tensors, unresized,
    spec and directory: validating, converting and looking up again cost more than a small kernel call."""
    seen = owner.__dict__.get("_tmac_binding")
    if seen is not None and seen[2] is spec and seen[0][0] is packed[0] and seen[0][1] is packed[1] and \
            seen[0][2] is packed[2] and seen[0][3] is packed[3] and seen[3] == kernel_dir and \
            seen[1] == tuple(-1 if t is None else t.numel() for t in packed):
        return seen[4]
    check_packed(spec, m, *packed)
    views = tuple(runtime.ffi().from_dlpack(t) for t in packed[:3] if t is not None)
    sizes = tuple(-1 if t is None else t.numel() for t in packed)
    seen = owner.__dict__["_tmac_binding"] = _Binding((packed, sizes, spec, kernel_dir,
                                                        (views, kernels_for(spec, kernel_dir))))
    return seen[4]


def _workspace(spec: KernelSpec, rows: int, dot: bool = False):
    """Per-thread table buffers (LUT, LS, XS), or with ``dot`` the dot-product GEMM's activations (XQ, XD, XS),
    reused across calls (no allocation per token), and their kernel views."""
    cache = getattr(_workspaces, "buffers", None)
    if cache is None:
        cache = _workspaces.buffers = {}
    key = (spec, rows, dot)
    entry = cache.get(key)
    if entry is None:
        bufs = dot_buffers(spec, rows) if dot else table_buffers(spec, rows)
        entry = cache[key] = (bufs, tuple(runtime.ffi().from_dlpack(t) for t in bufs))
    return entry


_prompt = threading.local()


@contextlib.contextmanager
def prompt_rows():
    """Calls of ``tmac.Linear`` inside are a prompt's rows (the eager model's prefill): they take dot products at any
    count, as the prefill plans' do (``takes_dot_products``)."""
    before = getattr(_prompt, "on", False)
    _prompt.on = True
    try:
        yield
    finally:
        _prompt.on = before


DOT_ROWS_ENV = "TMAC_DOT_ROWS"  # overrides the ISA's ``dot_rows`` (0: table lookups everywhere, prompts included)


def takes_dot_products(spec: KernelSpec, rows: int, prefill: bool = False) -> bool:
    """Whether ``rows`` activation rows take the dot-product GEMM (``KernelSpec.dot_products``) rather than table
    lookups: a call of ``tmac.Linear`` from the ISA's ``dot_rows`` (or ``TMAC_DOT_ROWS``) rows, a prompt's rows
    (``prefill``: the plans') at any count unless ``TMAC_DOT_ROWS=0`` — so that a prompt token's numbers do not
    depend on the chunk it is fed in (a server's pieces, a kept cache's remainder)."""
    if not spec.dot_products:
        return False
    value = os.environ.get(DOT_ROWS_ENV, "").strip()
    if value and not value.isdigit():
        raise ValueError(f"{DOT_ROWS_ENV}={value!r}: expected a row count (0: never take dot products)")
    if value and int(value) == 0:
        return False
    return prefill or rows >= (int(value) if value else ISAS[spec.isa].dot_rows)


def dot_padded_rows(spec: KernelSpec, rows: int) -> int:
    """``rows`` rounded up to the dot-product GEMM's tile of activation rows."""
    tile = ISAS[spec.isa].dot_tile_of(spec)[1]
    return -(-rows // tile) * tile


def dot_buffers(spec: KernelSpec, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zeroed XQ (int8), XD and XS (float32; ``tmac.base.reference.quantized_sums``) for ``rows``
    (``dot_padded_rows``) activation rows of ``spec``'s dot-product GEMM (rows past the activations stay zero: they are computed, never stored)."""
    k = spec.k
    return (torch.zeros((rows, k), dtype=torch.int8), torch.zeros((rows, k // spec.activation_block)),
            torch.zeros((rows, k // min(spec.group_size, QUANT_BLOCK))))


def table_buffers(spec: KernelSpec, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty LUT (int8), LS and XS (float32) for ``rows`` activation rows of ``spec``'s kernels."""
    return tuple(torch.empty(shape, dtype=torch.int8 if i == 0 else torch.float32)
                 for i, shape in enumerate(spec.table_shapes(rows)))


class LutWeight:
    """A weight ``[M, K]`` packed for the LUT kernels of one ISA (the kernel-level handle tests and benches use)."""

    def __init__(self, packed: PackedWeight, kernel_dir: str | None = None):
        self.spec: KernelSpec = packed.spec
        self.m = packed.m
        self.k = packed.spec.k
        self.weights = torch.from_numpy(packed.weights)
        self.scales = torch.from_numpy(packed.scales)
        self.zeros = None if packed.zeros is None else torch.from_numpy(packed.zeros)
        self.kernel_dir = kernel_dir

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, isa: str | None = None, kernel_dir: str | None = None,
                       **tiling) -> "LutWeight":
        target = isa_by_name(isa) if isa else best_isa()
        return cls(pack_for(qw, target, **tiling), kernel_dir)

    @property
    def kernels(self) -> runtime.KernelLibrary:
        return kernels_for(self.spec, self.kernel_dir)

    @property
    def nbytes(self) -> int:
        """Bytes a GEMV streams: packed weights and their parameters."""
        return sum(t.numel() * t.element_size() for t in (self.weights, self.scales, self.zeros) if t is not None)

    def copies(self, n: int) -> list["LutWeight"]:
        """``n`` handles on copies of the packed tensors, one after another in huge pages (``huge_page_copies``)."""
        from tmac.base.memory import huge_page_copies

        out = []
        for weights, scales, zeros in huge_page_copies((self.weights, self.scales, self.zeros), n):
            c = LutWeight.__new__(LutWeight)
            c.__dict__.update(self.__dict__, weights=weights, scales=scales, zeros=zeros)
            out.append(c)
        return out

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T`` for float32 ``x [N, K]``; returns float32 ``[N, M]``."""
        packed = (self.weights, self.scales, self.zeros, None)
        bound = bind_packed(self, self.spec, self.m, packed, self.kernel_dir)
        return lut_linear(x, *packed, self.spec, self.m, self.kernel_dir, out, bound)
