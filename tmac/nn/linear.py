"""``tmac.Linear``: a drop-in, inference-only ``nn.Linear`` whose weight is packed for the LUT kernels.

The kernel call is registered as the custom op ``tmac::lut_linear`` (with a fake implementation), so
``torch.compile`` and ``torch.export`` trace through it. Eager calls skip the dispatcher, whose cost per call
adds up over the ~200 linears of one decode step, and call the same checked function directly (docs/decisions.md,
"Eager calls").

The packed tensors (``qweight``, ``scales``, ``zeros``) and ``bias`` are uint8/float16/float32 on the CPU whatever
``model.to(...)`` asks for: they are what the kernels read. The state dict carries them plus an extra state
(format, kernel spec), so loading a state dict packed for another ISA or tiling repacks it for this machine.
"""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import torch
from torch import nn

from tmac.base.formats import WeightFormat
from tmac.kernels import best_isa, isa_by_name
from tmac.execution.lut_ops import bind_packed, check_packed, lut_linear
from tmac.base.memory import gather_into_arena
from tmac.quant.choose import fitting_block_rows, spec_for_format
from tmac.quant.layout import TripleCodes
from tmac.execution.packing import PackedWeight, pack, pack_for, unpack
from tmac.execution.packing import layout_checksum as packed_checksum
from tmac.base.qweight import QuantizedWeight
from tmac.quant.quantize import quantize_weight
from tmac.quant.spec import KernelSpec, packed_shapes

STATE_VERSION = 1
_PACKED = ("qweight", "scales", "zeros")
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def _spec(spec_json: str) -> KernelSpec:
    return KernelSpec.from_dict(json.loads(spec_json))


@torch.library.custom_op("tmac::lut_linear", mutates_args=())
def lut_linear_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                  bias: torch.Tensor | None, spec: str, out_features: int, kernel_dir: str) -> torch.Tensor:
    return lut_linear(x, qweight, scales, zeros, bias, _spec(spec), out_features, kernel_dir or None)


@lut_linear_op.register_fake
def _(x, qweight, scales, zeros, bias, spec, out_features, kernel_dir):
    return x.new_empty((x.shape[0], out_features), dtype=torch.float32)


# inputs whose magnitude reaches this are scaled down by a power of two first (exact): the kernels add activations
# into table entries and scale sums of K products in float32, which overflows from about 1e36 on
SAFE_INPUT = 2.0 ** 100


def _overflow_shift(x: torch.Tensor) -> int:
    """0 for inputs of ordinary size, else the power of two that brings their largest magnitude to 1."""
    top = float(x.abs().max()) if x.numel() else 0.0
    if top < SAFE_INPUT or top != top or top == float("inf"):
        return 0
    return math.frexp(top)[1]


def layout_checksum(spec: KernelSpec, *tensors) -> int:
    """``tmac.execution.packing.layout_checksum`` of packed tensors."""
    return packed_checksum(spec, *(None if t is None else t.detach().contiguous().view(torch.uint8).numpy()
                                   for t in tensors))


@functools.lru_cache(maxsize=256)  # (a model's layers share a few; each choice costs milliseconds)
def respec(fmt: WeightFormat, spec: KernelSpec, isa, rows: int) -> KernelSpec:
    """The spec weights packed as ``spec`` (``rows`` of them) take on ``isa`` (what loading them there repacks to):
    the same format and K, that ISA's tiling for them, and the saved parameter storage (super scales only where the
    weight's parameters factored, in the saved dtype)."""
    tiling = {"super_groups": spec.super_groups, "super_dtype": spec.scale_dtype, "super_exponent": spec.super_exponent}
    return fitting_block_rows(spec_for_format(fmt, spec.k, isa, **tiling), rows, fmt, isa, tiling)


class Linear(nn.Module):
    """``y = x Wᵀ + b`` with ``W`` quantized to ``bits`` (``tmac.base.formats.BITS``) in groups of ``group_size`` inputs.

    The constructor initializes like ``nn.Linear`` and quantizes that; real weights come through
    ``from_float``/``from_quantized`` or ``load_state_dict``.
    """

    repacked = False  # whether the last ``load_state_dict`` had to repack (weights packed for another spec)
    packed_for = None  # the ISA the last ``load_state_dict``'s weights were packed for

    def __init__(self, in_features: int, out_features: int, bias: bool = True, bits: int = 4,
                 group_size: int | str = 128, symmetric: bool = False, *, isa: str | None = None,
                 kernel_dir: str | None = None):
        super().__init__()
        ref = nn.Linear(in_features, out_features, bias=bias)
        qw = quantize_weight(ref.weight.detach(), bits=bits, group_size=group_size, symmetric=symmetric)
        self._set(qw, ref.bias, isa, kernel_dir)

    # ---- construction ----------------------------------------------------------------------------------------
    @classmethod
    def from_float(cls, linear: nn.Linear | torch.Tensor, bits: int = 4, group_size: int | str = 128,
                   symmetric: bool = False, *, ternary: bool = False, bias: torch.Tensor | None = None,
                   isa: str | None = None, kernel_dir: str | None = None) -> "Linear":
        """Quantize an ``nn.Linear`` (its bias is kept) or a float weight ``[out, in]`` (with optional ``bias``)."""
        if isinstance(linear, nn.Linear):
            weight, bias = linear.weight.detach(), linear.bias
        elif isinstance(linear, torch.Tensor):
            weight = linear.detach()
        else:
            raise TypeError(f"from_float takes an nn.Linear or a weight tensor, got {type(linear).__name__}")
        qw = quantize_weight(weight, bits=bits, group_size=group_size, symmetric=symmetric, ternary=ternary)
        return cls.from_quantized(qw, bias, isa=isa, kernel_dir=kernel_dir)

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: torch.Tensor | None = None, *, isa: str | None = None,
                       kernel_dir: str | None = None, **tiling) -> "Linear":
        if not isinstance(qw, QuantizedWeight):
            raise TypeError(f"from_quantized takes a tmac.QuantizedWeight, got {type(qw).__name__}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._set(qw, bias, isa, kernel_dir, **tiling)
        return self

    def _set(self, qw: QuantizedWeight, bias, isa, kernel_dir, **tiling) -> None:
        target = isa_by_name(isa) if isa else best_isa()
        self.format = qw.format
        self.kernel_dir = kernel_dir
        self._set_packed(pack_for(qw, target, **tiling), _check_bias(bias, qw.shape[0]))

    def _set_packed(self, packed: PackedWeight, bias: torch.Tensor | None) -> None:
        self.spec = packed.spec
        self._spec_json = packed.spec.to_json()
        self._shape = (packed.m, packed.spec.k)
        self.register_buffer("qweight", _tensor(packed.weights))
        self.register_buffer("scales", _tensor(packed.scales))
        self.register_buffer("zeros", None if packed.zeros is None else _tensor(packed.zeros))
        self.register_buffer("bias", bias)

    # the shape is the packed weights': read-only, since the kernel call trusts it (a larger out_features would
    # return uninitialised memory)
    @property
    def out_features(self) -> int:
        return self._shape[0]

    @property
    def in_features(self) -> int:
        return self._shape[1]

    @classmethod
    def _empty(cls, extra: dict, qweight, kernel_dir: str | None = None) -> "Linear":
        """A module shaped by a saved extra state, with placeholder weights, to be filled by ``load_state_dict``.
        ``qweight`` is the saved packed weight: the sizes in ``extra`` are trusted only when they match it, so a
        file cannot make this allocate more than its own tensors hold."""
        fmt, spec, m, bias = _parse_extra(extra)
        want = packed_shapes(spec, m)[0]
        if not isinstance(qweight, torch.Tensor) or tuple(qweight.shape) != want:
            raise ValueError(f"packed weight has shape {tuple(getattr(qweight, 'shape', ()))}, its extra state "
                             f"({spec.name}, {m} rows) implies {want}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.format, self.kernel_dir = fmt, kernel_dir
        local = respec(fmt, spec, best_isa(), m)
        w_shape, s_shape = packed_shapes(local, m)
        self.spec, self._spec_json, self._shape = local, local.to_json(), (m, local.k)

        def placeholder(shape, dtype):  # zeros of no memory (a model's worth of them was 33 MiB for a moment); the
            # kernels refuse them (not contiguous) should a lenient load leave one unfilled
            return torch.zeros((), dtype=getattr(torch, dtype)).expand(shape)

        self.register_buffer("qweight", placeholder(w_shape, "uint8"))
        self.register_buffer("scales", placeholder(s_shape, local.param_dtypes[0]))
        self.register_buffer("zeros", placeholder(s_shape, local.param_dtypes[1]) if local.has_zeros else None)
        self.register_buffer("bias", placeholder((m,), "float32") if bias else None)
        return self

    # ---- use -------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"tmac.Linear input must be a torch.Tensor, got {type(x).__name__}")
        if x.layout != torch.strided or x.is_nested:
            raise TypeError(f"tmac.Linear takes dense (strided) input, got layout {x.layout}"
                            + (" (nested)" if x.is_nested else ""))
        if x.dtype not in _INPUT_DTYPES:
            raise TypeError(f"tmac.Linear takes float32/bfloat16/float16 input, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"tmac.Linear expects input [..., {self.in_features}], got {list(x.shape)}")
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("tmac.Linear is inference-only and has no backward; run under torch.no_grad() or "
                               "torch.inference_mode(), or detach the input")
        if not x.is_cpu:
            raise ValueError(f"tmac.Linear runs on the CPU, got input on {x.device}")
        tracing = torch.compiler.is_compiling()
        rows = x.dim() == 2 and not tracing  # (eager calls skip what they can: each torch call costs a µs or two)
        x2 = x if rows else x.reshape(-1, self.in_features)
        if tracing or x2.is_neg() or x2.is_conj():  # lazy views made real
            x2 = x2.resolve_neg().resolve_conj()
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.to(torch.float32).contiguous()
        if type(x2) is torch.Tensor and not tracing:
            b = self._buffers  # (not four nn.Module.__getattr__ calls: this path is the layer's whole overhead)
            packed = (b["qweight"], b["scales"], b["zeros"], b["bias"])
            bound = bind_packed(self, self.spec, self.out_features, packed, self.kernel_dir)
            shift = _overflow_shift(x2)
            if shift:  # sums of huge inputs in the tables would overflow float32: a power of two out and back in
                x2 = x2 * 2.0 ** -shift
                packed = (*packed[:3], None)
            y = lut_linear(x2, *packed, self.spec, self.out_features, self.kernel_dir, bound=bound, checked=True)
            if shift:
                y = y * 2.0 ** shift + (b["bias"] if b["bias"] is not None else 0.0)
        else:  # tracing (dynamo, export, fake tensors): go through the registered op
            y = lut_linear_op(x2, self.qweight, self.scales, self.zeros, self.bias, self._spec_json,
                              self.out_features, self.kernel_dir or "")
        if not rows:
            y = y.reshape(*x.shape[:-1], self.out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def packed(self) -> PackedWeight:
        return PackedWeight(self.spec, self.out_features, self.qweight.numpy(), self.scales.numpy(),
                            None if self.zeros is None else self.zeros.numpy())

    def quantized_weight(self) -> QuantizedWeight:
        return unpack(self.packed(), self.format)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight ``[out, in]`` the packed data represents."""
        return torch.from_numpy(self.quantized_weight().dequantize())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"bits={self.format.bits}, group_size={self.format.group_size}, format={self.format.name}, "
                f"isa={self.spec.isa}")

    def _apply(self, fn, recurse=True):
        # .to(dtype)/.half() must not convert what the kernels read; keep the packed tensors as they are
        keep = {name: self._buffers.pop(name) for name in (*_PACKED, "bias")}
        try:
            return super()._apply(fn, recurse)
        finally:
            self._buffers.update(keep)

    # ---- state dict ------------------------------------------------------------------------------------------
    def get_extra_state(self) -> dict:
        state = {"version": STATE_VERSION, "format": self.format.to_dict(), "spec": json.loads(self._spec_json),
                 "out_features": self.out_features, "bias": self.bias is not None,
                 "checksum": layout_checksum(self.spec, self.qweight, self.scales, self.zeros)}
        if self.spec.triples:
            state["triples_layout"] = TripleCodes.VERSION
        return state

    def set_extra_state(self, state) -> None:  # handled in _load_from_state_dict, with the tensors
        pass

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        names = [*_PACKED, "bias", "_extra_state"]
        for key in state_dict:
            if key.startswith(prefix) and key[len(prefix):] not in names and "." not in key[len(prefix):]:
                unexpected_keys.append(key)
        if prefix + "_extra_state" not in state_dict:
            missing_keys.append(prefix + "_extra_state")
            return
        try:
            fmt, spec, m, has_bias = _parse_extra(state_dict[prefix + "_extra_state"])
            if fmt != self.format or m != self.out_features or spec.k != self.in_features:
                raise ValueError(f"checkpoint holds {fmt.name} [{m}, {spec.k}] but this layer is {self.format.name} "
                                 f"[{self.out_features}, {self.in_features}]")
            if has_bias != (self.bias is not None):
                raise ValueError(f"checkpoint {'has' if has_bias else 'lacks'} a bias, this layer "
                                 f"{'does not' if has_bias else 'does'}")
            if not has_bias and prefix + "bias" in state_dict and state_dict[prefix + "bias"] is not None:
                raise ValueError("the saved state says bias: false but holds a bias tensor: the file contradicts "
                                 "itself (damaged, or edited)")
            tensors = {}
            for name in names[:-1]:
                if name == "zeros" and not spec.has_zeros or name == "bias" and not has_bias:  # (IQ1_S grid: none)
                    continue
                if prefix + name not in state_dict:
                    missing_keys.append(prefix + name)
                    return
                tensors[name] = state_dict[prefix + name].detach().cpu().contiguous()
            zeros, bias = tensors.get("zeros"), tensors.get("bias")
            check_packed(spec, m, tensors["qweight"], tensors["scales"], zeros, bias)
            saved = state_dict[prefix + "_extra_state"].get("checksum")
            if type(saved) is not int:  # required: without it a changed spec would load and compute garbage
                raise ValueError("the saved layer has no layout checksum (saved by an older tmac?): save or convert "
                                 "it again")
            if saved != layout_checksum(spec, tensors["qweight"], tensors["scales"], zeros):
                raise ValueError("the packed weights do not match their kernel spec and checksum (the spec or the "
                                 "tensors were changed after saving): the file is damaged")
            incoming = PackedWeight(spec, m, tensors["qweight"].numpy(), tensors["scales"].numpy(),
                                    None if zeros is None else zeros.numpy())
            self.repacked, self.packed_for = spec != self.spec, spec.isa
            if self.repacked:  # packed for another ISA or tiling: repack for the one this layer runs
                incoming = pack(unpack(incoming, fmt), self.spec)
            self._set_packed(incoming, bias)
        except (ValueError, TypeError) as e:
            error_msgs.append(f"{prefix or 'tmac.Linear '}: {e}")


def _parse_extra(extra) -> tuple[WeightFormat, KernelSpec, int, bool]:
    if not isinstance(extra, dict) or extra.get("version") != STATE_VERSION:
        raise ValueError(f"not a tmac.Linear state (version {STATE_VERSION} expected): {extra!r:.200}")
    m, bias = extra.get("out_features"), extra.get("bias")
    if type(m) is not int or m < 1 or type(bias) is not bool:
        raise ValueError(f"malformed tmac.Linear state: out_features={m!r:.50}, bias={bias!r:.50}")
    spec = KernelSpec.from_dict(extra.get("spec"))
    if spec.triples and extra.get("triples_layout") != TripleCodes.VERSION:
        raise ValueError(f"weights packed in another ternary-triples layout ({extra.get('triples_layout')!r}, this "
                         f"tmac reads {TripleCodes.VERSION}): convert the model again")
    return WeightFormat.from_dict(extra.get("format")), spec, m, bias


def _check_bias(bias, m: int) -> torch.Tensor | None:
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or tuple(bias.shape) != (m,):
        raise ValueError(f"bias must be a float tensor of shape ({m},), got "
                         f"{getattr(bias, 'dtype', type(bias).__name__)} {tuple(getattr(bias, 'shape', ()))}")
    return bias.detach().to(torch.float32, copy=True).contiguous()


def _tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def gather_packed(model: nn.Module) -> nn.Module:
    """Move the packed tensors of every ``tmac.Linear`` in ``model`` into one huge-page arena, in module order (the
    order a forward pass reads them), and return ``model`` (``tmac.base.memory.gather_into_arena``)."""
    gather_into_arena([(m, name) for m in model.modules() if isinstance(m, Linear)
                       for name in ("qweight", "scales", "zeros", "bias") if getattr(m, name) is not None])
    return model
