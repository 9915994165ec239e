"""``tmac.quantize_model``: swap a model's ``nn.Linear`` layers for ``tmac.Linear`` in place (torchao style)."""

from __future__ import annotations

import fnmatch
import warnings
from typing import Callable, Iterable

from torch import nn

from tmac.base.float_linear import FLOAT_LINEARS
from tmac.base.formats import PER_ROW, PER_TENSOR, check_bits, check_group_size, kernels_take
from tmac.nn.linear import Linear, gather_packed
from tmac.base.progress import Progress

Skip = Callable[[str, nn.Module], bool] | Iterable[str] | str | None
HEAD = "lm_head"  # the output head of Hugging Face models: kept float unless asked for (most sensitive to rounding)


def quantize_model(model: nn.Module, bits: int = 4, group_size: int | str = 128, symmetric: bool = False, *,
                   skip: Skip = None, quantize_head: bool = False, ternary: bool = False, isa: str | None = None,
                   kernel_dir: str | None = None, progress: bool | None = None) -> nn.Module:
    """Replace every eligible ``nn.Linear`` of ``model`` by a ``tmac.Linear`` and return ``model``.

    ``skip``: names or fnmatch patterns, matched against a layer's full name (``model.layers.0.mlp.up_proj``)
    and its last component, or a callable ``(name, module) -> bool``: layers to keep float besides the head
    (``lm_head``), which stays float unless ``quantize_head=True``. Layers whose
    ``in_features`` the group size (and the kernels' multiple of 32) does not divide stay float, with one
    warning naming them. The packed tensors of all of ``model``'s ``tmac.Linear`` layers end in one huge-page arena
    (``tmac.nn.linear.gather_packed``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_model takes an nn.Module, got {type(model).__name__}")
    if not ternary:
        check_bits(bits)
    check_group_size(group_size)
    user_skip, head_skip = _skip_predicate(skip), _skip_predicate(None if quantize_head else HEAD)

    def skipped(name, module):
        return head_skip(name, module) or user_skip(name, module)

    targets, ineligible = [], []
    for name, module in model.named_modules():
        if type(module) not in FLOAT_LINEARS or skipped(name, module):
            continue
        k = module.in_features
        if not kernels_take(k) or group_size not in (PER_ROW, PER_TENSOR) and k % group_size:
            ineligible.append(f"{name} (in_features={k})")
        else:
            targets.append(name)
    if ineligible:
        warnings.warn(f"{len(ineligible)} linear layer(s) stay float because group_size={group_size} (and the "
                      f"kernels' multiple of 32) does not divide in_features: {', '.join(ineligible)}", stacklevel=2)
    with Progress(f"quantizing to {'ternary' if ternary else f'{bits} bits'}", len(targets), progress) as bar:
        for name in targets:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            layer = Linear.from_float(getattr(parent, child), bits=bits, group_size=group_size, symmetric=symmetric,
                                      ternary=ternary, isa=isa, kernel_dir=kernel_dir)
            setattr(parent, child, layer)
            bar.advance(name)
    return gather_packed(model)


def _skip_predicate(skip: Skip) -> Callable[[str, nn.Module], bool]:
    if skip is None:
        return lambda name, module: False
    if callable(skip):
        return lambda name, module: bool(skip(name, module))
    patterns = [skip] if isinstance(skip, str) else list(skip)
    if not all(isinstance(p, str) for p in patterns):
        raise TypeError("skip must be a callable, a name/pattern or a list of names/patterns")
    return lambda name, module: any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name.rpartition(".")[2], p)
                                    for p in patterns)
