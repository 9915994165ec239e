"""An independent oracle: a Llama GGUF's forward pass in float64 numpy, from the weights as the ``gguf`` package
dequantizes them and the metadata as the GGUF spec names it — no activation rounding, no tmac code.

RoPE is applied as llama.cpp's "normal" mode on the file's q/k rows as stored (pairs of adjacent dimensions),
so no row permutation is involved."""
from __future__ import annotations

import gguf
import numpy as np


def _field(reader, key):
    f = reader.fields[key]
    value = f.parts[f.data[0]]
    return value.tobytes().decode() if f.types[0] == gguf.GGUFValueType.STRING else value.item()


def _weights(reader) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float64, in numpy's [rows, cols] = GGUF's [ne1, ne0]."""
    out = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        out[t.name] = w.reshape([int(n) for n in reversed(t.shape)]) if w.ndim > 1 or len(t.shape) > 1 else w
    return out


def _rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, theta):  # x [T, heads, head_dim], adjacent pairs rotated
    t, _, d = x.shape
    freqs = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    angle = np.arange(t, dtype=np.float64)[:, None] * freqs[None, :]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def llama_logits(path: str, ids: list[int]) -> np.ndarray:
    """Logits ``[len(ids), vocab]`` of a ``llama`` GGUF for the prompt ``ids`` (positions 0..), causal attention."""
    reader = gguf.GGUFReader(path)
    arch = _field(reader, "general.architecture")
    meta = {k: _field(reader, f"{arch}.{k}") for k in ("block_count", "attention.head_count",
                                                         "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
                                                         "rope.freq_base")}
    w = _weights(reader)
    heads, kv_heads, eps = meta["attention.head_count"], meta["attention.head_count_kv"], \
        meta["attention.layer_norm_rms_epsilon"]
    x = w["token_embd.weight"][ids]
    t, dim = x.shape
    hd = dim // heads
    mask = np.triu(np.full((t, t), -np.inf), 1)
    for i in range(meta["block_count"]):
        p = f"blk.{i}."
        h = _rms_norm(x, w[p + "attn_norm.weight"], eps)
        q = _rope((h @ w[p + "attn_q.weight"].T).reshape(t, heads, hd), meta["rope.freq_base"])
        k = _rope((h @ w[p + "attn_k.weight"].T).reshape(t, kv_heads, hd), meta["rope.freq_base"])
        v = (h @ w[p + "attn_v.weight"].T).reshape(t, kv_heads, hd)
        k, v = (np.repeat(a, heads // kv_heads, axis=1) for a in (k, v))
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        att = np.einsum("hqk,khd->qhd", scores / scores.sum(-1, keepdims=True), v).reshape(t, dim)
        x = x + att @ w[p + "attn_output.weight"].T
        h = _rms_norm(x, w[p + "ffn_norm.weight"], eps)
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
    head = w.get("output.weight", w["token_embd.weight"])
    return _rms_norm(x, w["output_norm.weight"], eps) @ head.T
