"""BitNet b1.58's activation quantization: 8-bit per-token absmax in front of every ternary projection, as Hugging
Face's ``BitLinear`` computes it: ``y = (round(x·127/amax) @ Wq) / (127/amax · weight_scale)``. The rest of
BitNet (two extra RMSNorms, a squared-ReLU gated FFN) is what its ``LlamaConfig`` says (``tmac.models.family.llama``).
"""

from __future__ import annotations

import torch
from torch import nn


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """Per-token symmetric int8 fake quantization (absmax, rounded, clamped to [-128, 127])."""
    scale = 127.0 / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
    return (x * scale).round().clamp(-128, 127) / scale


class ActivationQuantized(nn.Module):
    """A ternary projection with BitNet's activation quantization in front of it."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(quantize_activations(x))
