"""``FloatLinear``: an ``nn.Linear`` whose weight may stay 16-bit, as a float16/bfloat16 checkpoint stores it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FloatLinear(nn.Linear):
    """``nn.Linear`` with a float32, float16 or bfloat16 weight. A 16-bit weight takes half of float32's bytes and
    streams in half the time (a decode step reads every weight once); the input is rounded to the weight's dtype,
    as llama.cpp does for its F16/BF16 tensors, and the output returns in the input's dtype."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:  # (on the meta device a skeleton's, for a loader to fill: no init to run)
            super().reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dtype == w.dtype:
            return super().forward(x)
        return F.linear(x.to(w.dtype), w, None if self.bias is None else self.bias.to(w.dtype)).to(x.dtype)


FLOAT_LINEARS = (nn.Linear, FloatLinear)  # the float projection types: quantize_model and tmac.load replace them


def exact_16bit(t: torch.Tensor) -> torch.Tensor:
    """A 16-bit ``t`` as it is; any other in float16 where that holds every value exactly (torch multiplies it
    fastest), else in bfloat16 where that does, else in float32."""
    if t.dtype in (torch.float16, torch.bfloat16):
        return t
    for dtype in (torch.float16, torch.bfloat16):
        narrow = exactly_in(t, dtype)
        if narrow is not None:
            return narrow
    return t.float()


CHECK_ELEMENTS = 1 << 22  # values checked at a time: a temporary per value of a whole head would be 100-400 MB


def exactly_in(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``t`` converted to ``dtype`` if every value survives (compared in float32 a slice of rows at a time: no
    float32 copy of a whole head), else None."""
    narrow = t.to(dtype)
    same = all(torch.equal(b.float(), a.float()) for a, b in zip(_row_slices(t), _row_slices(narrow)))
    return narrow if same else None


def all_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN or inf, checked a slice of rows at a time."""
    return all(torch.isfinite(rows).all() for rows in _row_slices(t))


def _row_slices(t: torch.Tensor):
    """``t`` as 2-D row slices of about ``CHECK_ELEMENTS`` values."""
    rows = t.reshape(len(t), -1) if t.dim() else t.reshape(1, 1)
    step = max(1, CHECK_ELEMENTS // max(1, rows.shape[1]))
    return (rows[i:i + step] for i in range(0, len(rows), step))
