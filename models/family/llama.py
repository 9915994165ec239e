"""The decoder every supported family shares, in plain PyTorch (gpt-fast style): RMSNorm, RoPE (Llama-3 and
LongRoPE scaling, partial rotary), grouped-query attention (q/k/v biases, per-head q/k norms, sliding windows), a
gated FFN; and the variations the config names, which an architecture record sets (``tmac.models.family.arch``): BitNet's
sub-norms (its activation quantization wraps the ternary projections, ``tmac.models.family.bitnet``), Gemma's norms after
attention and FFN, and its scaled embeddings.

One sequence at a time (batch 1). Tensors follow the Hugging Face layout (q/k rows in "rotate half" order);
loaders convert other layouts (GGUF's interleaved q/k rows) when they read a file. Each layer runs two
projections instead of five: ``wqkv`` (q, k, v rows stacked) and ``w13`` (gate, up stacked), one kernel call
each. The KV cache is preallocated to the context size, float16 by default (as llama.cpp), in the layout the
decode glue reads (``tmac.base.glue.KV_BLOCK``); ``forward(ids, start)`` appends to it.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tmac.base.float_linear import FloatLinear
from tmac.base.glue import ACTIVATIONS, KV_BLOCK, check_kv_dtype
from tmac.base.memory import available_bytes, fresh_zeros


KV_MEMORY_SHARE = 0.8  # of the available memory a KV cache may take

# upper bounds far above any real model: a config from a file is untrusted, and sizes drive allocations
LIMITS = {"vocab_size": 1 << 22, "dim": 1 << 16, "n_layers": 1 << 10, "n_heads": 1 << 10, "n_kv_heads": 1 << 10,
          "ffn_dim": 1 << 18, "head_dim": 1 << 10, "context_length": 1 << 24}


def _valid_rope_scaling(s) -> bool:
    """Llama 3's (by wavelength) or linear scaling, with the numbers each needs."""
    kind = s.get("rope_type", s.get("type")) if isinstance(s, dict) else None
    if kind == "linear":
        factor = s.get("factor")
        return isinstance(factor, (int, float)) and not isinstance(factor, bool) and 0 < factor < 1e6
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    if kind != "llama3" or not all(isinstance(s.get(k), (int, float)) and not isinstance(s.get(k), bool)
                                          and 0 < s[k] < 1e30 for k in keys):
        return False
    return s["low_freq_factor"] < s["high_freq_factor"]


def _valid_rope_factors(factors, head_dim) -> bool:
    return isinstance(factors, list) and len(factors) == head_dim // 2 and all(
        isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f < 1e30 for f in factors)


@dataclass
class LlamaConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int = 0  # 0: dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # rope_type llama3 (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings) or linear (factor)
    rope_factors: list | None = None  # [head_dim/2] divisors of the RoPE frequencies (a GGUF's rope_freqs.weight)
    context_length: int = 2048  # what the model was trained for
    tie_embeddings: bool = False
    activation: str = "silu"  # of the gated FFN: one of tmac.base.glue.ACTIVATIONS (BitNet: relu2, squared ReLU)
    sub_norms: bool = False  # BitNet: an RMSNorm before the attention output and before the down projection
    arch: str = "llama"  # the architecture record (tmac.models.family.arch) the rest follows from
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each head of q and k, before RoPE
    post_norms: bool = False  # Gemma: RMSNorms on the attention's and the FFN's outputs, before the residual
    pre_norms: bool = True  # RMSNorms on the attention's and the FFN's inputs (OLMo 2: none)
    qk_norm_whole: bool = False  # OLMo 2: qk_norm over all of q's heads at once (and k's), not each head
    embed_scale: float = 1.0  # Gemma: the token embeddings times √dim
    attn_scale: float = 0.0  # the scores' scale; 0: head_dim^-½
    rotary_dim: int = 0  # leading dimensions of each head that RoPE turns; 0: all
    sliding_window: int = 0  # positions a sliding-window layer sees (itself included); 0: none
    sliding_layers: list | None = None  # the layers with a sliding window (Gemma 3: five of every six)
    rope_local_theta: float = 0.0  # the sliding layers' RoPE base; 0: rope_theta
    rope_factors_long: list | None = None  # LongRoPE: the divisors past rope_original_context (rope_factors below)
    rope_original_context: int = 0
    rope_attn_factor: float = 1.0  # LongRoPE: cos and sin scaled by it
    attn_softcap: float = 0.0  # Gemma 2: attention scores s become c·tanh(s/c); 0: none
    final_softcap: float = 0.0  # Gemma 2: logits likewise
    residual_scale: float = 1.0  # Granite: the attention's and the FFN's outputs times it, then added to the residual
    logit_scale: float = 1.0  # Granite: the logits divided by it
    nope_layers: list | None = None  # SmolLM3: the layers whose q and k RoPE leaves unturned (every fourth)

    @property
    def family(self) -> str:
        return self.arch

    def __post_init__(self):
        problems = [f"{name}={getattr(self, name)!r:.40}" for name, most in LIMITS.items()
                    if type(getattr(self, name)) is not int or not 0 <= getattr(self, name) <= most]
        if not problems and self.head_dim == 0 and self.n_heads:
            self.head_dim = self.dim // self.n_heads
            if self.head_dim > LIMITS["head_dim"]:  # (derived: dim 4096 in one head ran for minutes)
                problems.append(f"head_dim={self.head_dim} (dim {self.dim} / {self.n_heads} heads; at most "
                                f"{LIMITS['head_dim']})")
        problems += [f"{name}={getattr(self, name)!r}" for name in LIMITS if getattr(self, name) == 0]
        for name, most in (("norm_eps", 1.0), ("rope_theta", 1e12)):  # (real models: 1e-6..1e-5, 1e4..1e8)
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= most:
                problems.append(f"{name}={value!r:.40}")
            else:
                setattr(self, name, float(value))
        if self.activation not in ACTIVATIONS or type(self.sub_norms) is not bool or type(self.tie_embeddings) is not bool:
            problems.append(f"activation={self.activation!r:.40} (one of {ACTIVATIONS}), sub_norms={self.sub_norms!r:.20}, "
                            f"tie_embeddings={self.tie_embeddings!r:.20}")
        problems += self._check_variations()
        if not problems and not self.rotary_dim:
            self.rotary_dim = self.head_dim
        for name in ("rope_factors", "rope_factors_long"):
            if getattr(self, name) is not None and not _valid_rope_factors(getattr(self, name), self.rotary_dim):
                problems.append(f"{name}={getattr(self, name)!r:.80} (rotary_dim/2 = {self.rotary_dim // 2} positive "
                                f"finite numbers)")
        if self.rope_scaling is not None and not _valid_rope_scaling(self.rope_scaling):
            problems.append(f"rope_scaling={self.rope_scaling!r:.200} (linear needs a factor; llama3 numbers factor, "
                            f"low_freq_factor < high_freq_factor, original_max_position_embeddings)")
        if not problems and self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if not problems and (self.head_dim % 2 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim):
            problems.append(f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}: RoPE turns an even number of "
                            f"a head's dimensions")
        if problems:
            raise ValueError("invalid model config: " + ", ".join(problems))

    def _check_variations(self) -> list[str]:
        from tmac.models.family.arch import ARCHITECTURES

        problems = []
        if self.arch not in ARCHITECTURES:
            problems.append(f"arch={self.arch!r:.40} (one of {', '.join(ARCHITECTURES)})")
        for name in ("qkv_bias", "qk_norm", "post_norms", "pre_norms", "qk_norm_whole"):
            if type(getattr(self, name)) is not bool:
                problems.append(f"{name}={getattr(self, name)!r:.20}")
        for name, low, most in (("embed_scale", 0.0, 1e4), ("attn_scale", -1e-30, 10.0), ("rope_local_theta", -1e-30, 1e12),
                                ("rope_attn_factor", 0.0, 100.0), ("attn_softcap", -1e-30, 1e4),
                                ("final_softcap", -1e-30, 1e4), ("residual_scale", 0.0, 1e4),
                                ("logit_scale", 0.0, 1e6)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value <= most:
                problems.append(f"{name}={value!r:.40}")
            else:
                setattr(self, name, float(value))
        for name in ("rotary_dim", "sliding_window", "rope_original_context"):
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value <= LIMITS["context_length"]:
                problems.append(f"{name}={value!r:.40}")
        layers = self.sliding_layers
        if layers is not None and (not isinstance(layers, list) or len(layers) > LIMITS["n_layers"] or not all(
                type(i) is int and 0 <= i < self.n_layers for i in layers) or not self.sliding_window):
            problems.append(f"sliding_layers={layers!r:.60} (layer indices below n_layers, with a sliding_window)")
        layers = self.nope_layers
        if layers is not None and (not isinstance(layers, list) or len(layers) > LIMITS["n_layers"] or not all(
                type(i) is int and 0 <= i < self.n_layers for i in layers)):
            problems.append(f"nope_layers={layers!r:.60} (layer indices below n_layers)")
        return problems

    def window(self, layer: int) -> int:
        """The positions layer ``layer`` attends to (0: all)."""
        if not self.sliding_window:
            return 0
        return self.sliding_window if self.sliding_layers is None or layer in self.sliding_layers else 0


def expected_shape(cfg: LlamaConfig, name: str) -> tuple[int, ...]:
    """The shape of parameter ``name`` (unfused naming: wq/wk/wv, w1/w3) that ``cfg`` implies."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes = {"tok_embeddings.weight": (cfg.vocab_size, cfg.dim), "norm.weight": (cfg.dim,),
              "output.weight": (cfg.vocab_size, cfg.dim), "attention_norm.weight": (cfg.dim,),
              "ffn_norm.weight": (cfg.dim,), "attention.wq.weight": (q, cfg.dim), "attention.wk.weight": (kv, cfg.dim),
              "attention.wv.weight": (kv, cfg.dim), "attention.wo.weight": (cfg.dim, q),
              "feed_forward.w1.weight": (cfg.ffn_dim, cfg.dim), "feed_forward.w3.weight": (cfg.ffn_dim, cfg.dim),
              "feed_forward.w2.weight": (cfg.dim, cfg.ffn_dim), "attention.out_norm.weight": (q,),
              "feed_forward.hidden_norm.weight": (cfg.ffn_dim,), "attention.wq.bias": (q,), "attention.wk.bias": (kv,),
              "attention.wv.bias": (kv,), "attention.q_norm.weight": (q if cfg.qk_norm_whole else cfg.head_dim,),
              "attention.k_norm.weight": (kv if cfg.qk_norm_whole else cfg.head_dim,),
              "post_attention_norm.weight": (cfg.dim,),
              "post_ffn_norm.weight": (cfg.dim,), "attention.wqkv.weight": (q + 2 * kv, cfg.dim),
              "feed_forward.w13.weight": (2 * cfg.ffn_dim, cfg.dim)}
    return shapes[name.split(".", 2)[2] if name.startswith("layers.") else name]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # x·rsqrt(mean(x²) + eps)·weight, as one fused op (half the time of five small ones)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_frequencies(cfg: LlamaConfig, local: bool = False, context: int = 0) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim/2]`` (float64) of a global layer, or of a sliding-window one (``local``:
    its own base, unscaled), for a cache of ``context`` positions: with the scaling configured — ``rope_scaling``
    from Hugging Face (``llama3``: by wavelength; ``linear``: every frequency divided by the factor), or the
    per-frequency divisors a file gives (``rope_factors``; LongRoPE's long ones past ``rope_original_context``)."""
    theta = cfg.rope_local_theta if local and cfg.rope_local_theta else cfg.rope_theta
    inv = 1.0 / theta ** (torch.arange(0, cfg.rotary_dim, 2, dtype=torch.float64) / cfg.rotary_dim)
    if local:
        return inv
    s = cfg.rope_scaling or {}
    kind = s.get("rope_type", s.get("type"))
    if kind == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        mid = (wavelen <= old / low) & (wavelen >= old / high)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "linear":
        inv = inv / s["factor"]
    factors = cfg.rope_factors
    if cfg.rope_factors_long is not None and context > cfg.rope_original_context:
        factors = cfg.rope_factors_long
    if factors is not None:  # as llama.cpp applies rope_freqs.weight: each frequency divided by its factor
        inv = inv / torch.tensor(factors, dtype=torch.float64)
    return inv


def rope_table(cfg: LlamaConfig, context: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[context, 1, rotary_dim]`` (float32), each frequency twice ("rotate half" pairs)."""
    angles = torch.arange(context, dtype=torch.float64)[:, None] * rope_frequencies(cfg, local, context)[None]
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]
    scale = 1.0 if local else cfg.rope_attn_factor
    return (angles.cos() * scale).float(), (angles.sin() * scale).float()


def apply_rope(x, cos, sin):
    """``x [T, heads, head_dim]`` rotated by position: the "rotate half" pairing (i, i + rotary_dim/2) over the
    leading ``rotary_dim`` (cos's width) dimensions; the rest pass through."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def write_keys(cache_k, start: int, keys) -> None:
    """Store ``keys [kv heads, T, head_dim]`` at positions ``start ..`` of one layer's blocked key cache."""
    at = torch.arange(start, start + keys.shape[1])
    cache_k.transpose(-1, -2)[:, at // KV_BLOCK, at % KV_BLOCK] = keys.to(cache_k.dtype)


def read_keys(cache_k, end: int):
    """Positions ``0 .. end-1`` of one layer's blocked key cache as float32 ``[kv heads, end, head_dim]``."""
    kv, _, hd, _ = cache_k.shape
    blocks = -(-end // KV_BLOCK)
    keys = torch.empty((kv, blocks, KV_BLOCK, hd))
    keys.copy_(cache_k[:, :blocks].transpose(-1, -2))  # one pass: transposed and widened
    return keys.view(kv, blocks * KV_BLOCK, hd)[:, :end]


def relu2(x):
    return F.relu(x).square()


def gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


# LlamaConfig.activation → its function
ACTIVATION_FUNCTIONS = {"silu": F.silu, "relu2": relu2, "gelu_tanh": gelu_tanh}


def _norm_or_none(present: bool, dim: int, eps: float) -> nn.Module:
    return RMSNorm(dim, eps) if present else nn.Identity()


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int = 0):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.scale = cfg.attn_scale or cfg.head_dim ** -0.5
        self.softcap = cfg.attn_softcap
        self.window = cfg.window(layer)
        self.local = bool(self.window) and cfg.rope_local_theta > 0
        self.wqkv = FloatLinear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = FloatLinear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.qk_norm_whole = cfg.qk_norm_whole
        self.q_norm = _norm_or_none(cfg.qk_norm, cfg.head_dim * (cfg.n_heads if cfg.qk_norm_whole else 1), cfg.norm_eps)
        self.k_norm = _norm_or_none(cfg.qk_norm, cfg.head_dim * (cfg.n_kv_heads if cfg.qk_norm_whole else 1),
                                    cfg.norm_eps)
        self.out_norm = _norm_or_none(cfg.sub_norms, cfg.n_heads * cfg.head_dim, cfg.norm_eps)

    def forward(self, x, cos, sin, cache_k, cache_v, start: int):
        return self.wo(self.out_norm(self.attend(self.wqkv(x), cos, sin, cache_k, cache_v, start)))

    def forward_rows(self, x, cos, sin, caches_k: list, caches_v: list, starts: list[int]):
        """Row r of ``x`` is the new token of its own sequence (cache ``caches_k[r]``, position ``starts[r]``): the
        projections run once for all rows, attention row by row."""
        qkv = self.wqkv(x)
        out = torch.cat([self.attend(qkv[r:r + 1], cos[r:r + 1], sin[r:r + 1], caches_k[r], caches_v[r], start)
                         for r, start in enumerate(starts)])
        return self.wo(self.out_norm(out))

    def _capped(self, scores):
        return scores if not self.softcap else torch.tanh(scores / self.softcap) * self.softcap

    def attend(self, qkv, cos, sin, cache_k, cache_v, start: int):
        """The heads' outputs ``[t, heads·head_dim]`` of projected rows ``qkv`` at positions ``start …``, their keys
        and values written to the cache."""
        t, h = qkv.shape[0], self.n_heads
        qk_width = (h + self.n_kv) * self.hd
        if self.qk_norm_whole:  # (OLMo 2) each of q and k normalized as one vector
            q_width = h * self.hd
            qk = torch.cat((self.q_norm(qkv[:, :q_width]), self.k_norm(qkv[:, q_width:qk_width])), dim=1)
            qk = qk.view(t, h + self.n_kv, self.hd)
        else:
            qk = qkv[:, :qk_width].view(t, h + self.n_kv, self.hd)
        if not isinstance(self.q_norm, nn.Identity) and not self.qk_norm_whole:
            qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)
        qk = apply_rope(qk, cos, sin)  # q and k at once
        q, k = qk[:, :h], qk[:, h:]
        end = start + t
        write_keys(cache_k, start, k.transpose(0, 1))
        cache_v[:, start:end] = qkv[:, qk_width:].view(t, self.n_kv, self.hd).transpose(0, 1)
        first = max(0, end - self.window) if self.window and t == 1 else 0  # what a sliding window still sees
        keys, values = read_keys(cache_k, end)[None, :, first:], cache_v[None, :, first:end].float()
        if t == 1:  # one new token sees everything cached: no mask, and plain matmuls beat SDPA's setup
            group = h // self.n_kv
            scores = (q.view(self.n_kv, group, self.hd) * self.scale) @ keys[0].transpose(1, 2)
            return (self._capped(scores).softmax(-1) @ values[0]).view(1, h * self.hd)
        q = q.transpose(0, 1)[None]
        if start == 0 and not self.window and not self.softcap:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True, scale=self.scale)
        else:  # a chunk after cached tokens, a sliding window or capped scores: causal with an offset, maybe a window
            rows, cols = torch.arange(start, end)[:, None], torch.arange(end)[None]
            mask = cols <= rows
            if self.window:
                mask &= cols > rows - self.window
            if self.softcap:  # Gemma 2: scores capped before the mask, which SDPA cannot do
                group = h // self.n_kv
                scores = (q[0].reshape(self.n_kv, group, t, self.hd) * self.scale) @ keys[0][:, None].transpose(2, 3)
                scores = self._capped(scores).masked_fill(~mask, float("-inf"))
                out = (scores.softmax(-1) @ values[0][:, None]).view(h, t, self.hd)[None]
            else:
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True,
                                                     scale=self.scale)
        return out[0].transpose(0, 1).reshape(t, h * self.hd)


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.ffn_dim = cfg.ffn_dim
        self.w13 = FloatLinear(cfg.dim, 2 * cfg.ffn_dim, bias=False)  # gate rows, then up rows
        self.w2 = FloatLinear(cfg.ffn_dim, cfg.dim, bias=False)
        self.act = ACTIVATION_FUNCTIONS[cfg.activation]
        self.hidden_norm = _norm_or_none(cfg.sub_norms, cfg.ffn_dim, cfg.norm_eps)

    def forward(self, x):
        gate, up = self.w13(x).split(self.ffn_dim, dim=-1)
        return self.w2(self.hidden_norm(self.act(gate) * up))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int = 0):
        super().__init__()
        self.residual_scale = cfg.residual_scale
        self.attention_norm = _norm_or_none(cfg.pre_norms, cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, layer)
        self.ffn_norm = _norm_or_none(cfg.pre_norms, cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        self.post_attention_norm = _norm_or_none(cfg.post_norms, cfg.dim, cfg.norm_eps)
        self.post_ffn_norm = _norm_or_none(cfg.post_norms, cfg.dim, cfg.norm_eps)

    def forward(self, x, cos, sin, cache_k, cache_v, start):
        h = x + self._scaled(self.post_attention_norm(self.attention(self.attention_norm(x), cos, sin, cache_k,
                                                                    cache_v, start)))
        return h + self._scaled(self.post_ffn_norm(self.feed_forward(self.ffn_norm(h))))

    def forward_rows(self, x, cos, sin, caches_k, caches_v, starts):
        h = x + self._scaled(self.post_attention_norm(self.attention.forward_rows(self.attention_norm(x), cos, sin,
                                                                                  caches_k, caches_v, starts)))
        return h + self._scaled(self.post_ffn_norm(self.feed_forward(self.ffn_norm(h))))

    def _scaled(self, out):
        return out if self.residual_scale == 1.0 else out * self.residual_scale


def _embedding(n: int, dim: int) -> nn.Embedding:
    """A token table, random; on the meta device (``Transformer.skeleton``) uninitialized."""
    weight = torch.empty(n, dim)
    return nn.Embedding(n, dim, _weight=weight) if weight.is_meta else nn.Embedding(n, dim)


class Transformer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.tokenizer = None  # set by the loader
        self.packed_copy = None  # the packed copy of a GGUF it was mapped from or written to (models/files/packed_cache.py)
        self.cache_owner = None  # a weak reference to the Sequence that holds this model's own cache (models/run/sequence.py)
        self.tok_embeddings = _embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = FloatLinear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.context = 0
        self.kv_dtype = "float16"
        self.cache_k = self.cache_v = self.cos = self.sin = self.cos_local = self.sin_local = None
        self.cos_none = self.sin_none = None  # the tables of a layer without RoPE: cos 1, sin 0 (x unturned, exactly)

    @classmethod
    def skeleton(cls, cfg: LlamaConfig) -> "Transformer":
        """The modules on the meta device, uninitialized, for a loader to fill. (Random init on meta tensors
        goes through torch's Python reference ops, which import torch._dynamo: 1.6 s for nothing; the modules skip
        it there: ``_embedding``, ``FloatLinear.reset_parameters``.)"""
        with torch.device("meta"):
            return cls(cfg)

    def setup_cache(self, context: int, kv_dtype: str = "float16") -> None:
        """Preallocate the model's own KV cache (``kv_dtype``: float16 or float32) and the RoPE tables for
        ``context`` positions: the most any ``Sequence`` of this model holds."""
        check_kv_dtype(kv_dtype)
        if (self.context, self.kv_dtype) == (context, kv_dtype) and self.cache_k is not None:
            return
        if context > self.config.context_length:
            warnings.warn(f"context {context} is longer than the {self.config.context_length} positions the model was "
                          f"trained for: text past them is likely to degrade", stacklevel=3)
        freed = self.cache_bytes()  # the old cache's memory comes back first
        self.cache_k = self.cache_v = None
        self.cache_k, self.cache_v = self.new_kv(context, kv_dtype, freed)
        self.kv_dtype = kv_dtype
        self.cache_owner = None  # a new cache holds nothing
        self.cos, self.sin = rope_table(self.config, context)
        if any(layer.attention.local for layer in self.layers):
            self.cos_local, self.sin_local = rope_table(self.config, context, local=True)
        if self.config.nope_layers:
            self.cos_none, self.sin_none = torch.ones_like(self.cos), torch.zeros_like(self.sin)
        self.context = context

    def rope(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin tables layer ``layer`` turns q and k with."""
        if self.config.nope_layers and layer in self.config.nope_layers:
            return self.cos_none, self.sin_none
        if self.layers[layer].attention.local:
            return self.cos_local, self.sin_local
        return self.cos, self.sin

    def new_kv(self, context: int, kv_dtype: str, freed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A KV cache of ``context`` positions: keys ``[layers, kv heads, blocks, head_dim, KV_BLOCK]`` and values
        ``[layers, kv heads, positions, head_dim]``, in the layout the decode glue reads; refused when it would take
        more than ``KV_MEMORY_SHARE`` of the memory available (``freed``: bytes about to come back)."""
        cfg = self.config
        blocks, dtype = -(-context // KV_BLOCK), getattr(torch, kv_dtype)
        need = self.kv_bytes(context, kv_dtype)
        free = available_bytes()
        # a margin stays for the activations and the process around it
        if free is not None and need > (free + freed) * KV_MEMORY_SHARE:
            raise ValueError(f"a KV cache of {context} positions ({kv_dtype}) needs {need / 2**30:.2f} GiB, more "
                             f"than {KV_MEMORY_SHARE:.0%} of the {free / 2**30:.2f} GiB of memory available "
                             f"(the machine's, or its container's): give a smaller context")
        return (fresh_zeros((cfg.n_layers, cfg.n_kv_heads, blocks, cfg.head_dim, KV_BLOCK), dtype),
                fresh_zeros((cfg.n_layers, cfg.n_kv_heads, blocks * KV_BLOCK, cfg.head_dim), dtype))

    def kv_bytes(self, context: int, kv_dtype: str) -> int:
        """Bytes of a KV cache of ``context`` positions (``new_kv``'s)."""
        cfg = self.config
        return 2 * cfg.n_layers * cfg.n_kv_heads * -(-context // KV_BLOCK) * KV_BLOCK * cfg.head_dim * \
            getattr(torch, kv_dtype).itemsize

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.cache_k, self.cache_v) if t is not None)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(ids).float()  # loaders may keep the table in float16
        return x * self.config.embed_scale if self.config.embed_scale != 1.0 else x

    def forward(self, ids: torch.Tensor, start: int = 0, last_only: bool = False, cache=None) -> torch.Tensor:
        """Logits ``[T, vocab]`` (or ``[1, vocab]`` with ``last_only``) for tokens ``ids [T]`` at positions
        ``start .. start+T-1`` of the sequence whose KV cache is ``cache`` (a ``Sequence``; default: the model's
        own), which must hold positions ``< start``."""
        t = ids.shape[0]
        cache_k, cache_v, context = (self.cache_k, self.cache_v, self.context) if cache is None else \
            (cache.k, cache.v, cache.context)
        if start + t > context:
            raise ValueError(f"{start + t} positions exceed the context of {context} tokens")
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            cos, sin = self.rope(i)
            x = layer(x, cos[start:start + t], sin[start:start + t], cache_k[i], cache_v[i], start)
        if last_only:
            x = x[-1:]
        return self.logits(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head's float32 logits of the last layer's output ``x`` (Granite: divided; Gemma 2: capped)."""
        out = self.output(self.norm(x)).float()
        if self.config.logit_scale != 1.0:
            out = out / self.config.logit_scale
        cap = self.config.final_softcap
        return out if not cap else torch.tanh(out / cap) * cap

    def forward_rows(self, ids: torch.Tensor, starts: list[int], caches: list) -> torch.Tensor:
        """Logits ``[n, vocab]`` of one new token for each of n sequences: ``ids[r]`` at position ``starts[r]`` of
        ``caches[r]`` (a ``Sequence``, holding the positions before it). One step of continuous batching: every
        projection runs once for all the rows (the LUT GEMM reads each weight once for them), attention per row."""
        if not len(ids) == len(starts) == len(caches):
            raise ValueError(f"{len(ids)} ids, {len(starts)} positions and {len(caches)} caches: one each per row")
        for start, cache in zip(starts, caches):
            if not 0 <= start < cache.context:
                raise ValueError(f"position {start} is outside a sequence's context of {cache.context} tokens")
        x = self.embed(ids)
        at = torch.tensor(starts)
        for i, layer in enumerate(self.layers):
            cos, sin = self.rope(i)
            x = layer.forward_rows(x, cos[at], sin[at], [c.k[i] for c in caches], [c.v[i] for c in caches], starts)
        return self.logits(x)


class Concat(nn.Module):
    """Layers run on the same input, outputs concatenated: a fused projection whose parts differ in format."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x):
        return torch.cat([p(x) for p in self.parts], dim=-1)
