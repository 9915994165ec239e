"""BitNet b1.58: the Llama block with two extra RMSNorms (before the attention output projection and before
the down projection), a squared-ReLU gated FFN, ternary weights with one scale per tensor, and 8-bit
per-token absmax activation quantization in front of every ternary projection — as Hugging Face's
``BitLinear`` computes it: ``y = (round(x·127/amax) @ Wq) / (127/amax · weight_scale)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .llama import LlamaConfig, RMSNorm, Transformer


def relu2(x):
    return F.relu(x).square()


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


class BitNetTransformer(Transformer):
    def __init__(self, cfg: LlamaConfig):
        super().__init__(cfg)
        for layer in self.layers:
            layer.attention.out_norm = RMSNorm(cfg.n_heads * cfg.head_dim, cfg.norm_eps)
            layer.feed_forward.act = relu2
            layer.feed_forward.hidden_norm = RMSNorm(cfg.ffn_dim, cfg.norm_eps)
