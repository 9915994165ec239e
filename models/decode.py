"""The static decode path: one token through the model with no torch op and no allocation per layer.

``DecodePlan.build(model)`` resolves, once per generation, every tensor a step touches into a handle the
compiled code takes directly: the packed weights of each LUT projection, the preallocated activations, table
buffers and KV cache. A layer is then three or four glue-kernel calls (``tmac.glue``) and one kernel call per
projection, straight from Python. What the plan cannot run (a float projection, a module it does not know)
makes ``build`` return ``None`` and generation stays on the eager ``forward``; a float part of a projection
(e.g. an unquantized head) runs as one ``torch.mm`` into its slice of the output.
"""

from __future__ import annotations

import functools
import time

import torch
from torch import nn

from tmac import runtime
from tmac.embedding import Embedding
from tmac.float_linear import FLOAT_LINEARS, FloatLinear
from tmac.formats import PER_TENSOR
from tmac.glue import ATTEND_ARGS, GlueSpec
from tmac.kernels import isa_by_name
from tmac.linear import Linear
from tmac.lut_ops import check_packed, kernels_for, table_buffers

from .bitnet import ActivationQuantized
from .llama import ACTIVATION_FUNCTIONS, Concat, RMSNorm


class _Unsupported(Exception):
    pass


def _handle(t: torch.Tensor):
    """A zero-copy tvm_ffi view: passing it skips the per-call DLPack conversion of a torch tensor."""
    return runtime.ffi().from_dlpack(t)


def _projection(module: nn.Module, x: torch.Tensor, out: torch.Tensor, tables: dict, labels: dict) -> list:
    """The calls computing ``out = x @ Wᵀ`` for one fused projection: LUT parts one ``lut_gemv`` (tables and
    GEMV in one call), float parts one ``torch.mm``, each into its column slice of ``out`` (contiguous: one row)."""
    parts = list(module.parts) if isinstance(module, Concat) else [module]
    calls, start = [], 0
    for part in parts:
        m = part.out_features
        dest = out[:, start:start + m]
        if isinstance(part, Linear):
            spec = part.spec
            check_packed(spec, m, part.qweight, part.scales, part.zeros, part.bias)
            if part.bias is not None:
                raise _Unsupported("a LUT projection with a bias")
            kernels = kernels_for(spec, part.kernel_dir)
            key = spec.table_shapes(1)
            if key not in tables:
                tables[key] = table_buffers(spec, 1)
            lut = [_handle(t) for t in tables[key]]
            params = [_handle(t) for t in (part.qweight, part.scales, part.zeros) if t is not None]
            calls.append((kernels.lut_gemv, [_handle(x), *params, *lut, _handle(dest)]))
            labels[id(kernels.lut_gemv)] = "lut_gemv (tables included)"
        elif type(part) in FLOAT_LINEARS and part.bias is None and part.weight.dtype == torch.float32:
            calls.append((functools.partial(torch.mm, out=dest), [x, part.weight.detach().t()]))
            labels[id(calls[-1][0])] = "float projection (torch.mm)"
        elif type(part) is FloatLinear and part.bias is None and part.weight.dtype in (torch.float16, torch.bfloat16):
            w = part.weight.detach()  # 16-bit: the input rounded to its dtype, the output widened (FloatLinear)
            x16, y16 = torch.empty(x.shape, dtype=w.dtype), torch.empty(dest.shape, dtype=w.dtype)
            calls += [(x16.copy_, [x]), (functools.partial(torch.mm, out=y16), [x16, w.t()]), (dest.copy_, [y16])]
            labels.update({id(fn): "float projection (torch.mm)" for fn, _ in calls[-3:]})
        else:
            raise _Unsupported(f"projection part {type(part).__name__}")
        start += m
    if start != out.shape[1]:
        raise _Unsupported("projection widths do not add up")
    return calls


def glue_spec(cfg, act_quant: bool, isa, kv_dtype: str = "float16", table=None) -> GlueSpec:
    """The glue kernels a model of config ``cfg`` (with int8 activations in front of some projections with
    ``act_quant``) decodes with on ``isa``, with a KV cache of ``kv_dtype`` and the token table module ``table`` (a
    quantized one gets its lookup compiled)."""
    embed = {}
    if isinstance(table, Embedding):
        fmt = table.format
        embed = dict(embed_bits=fmt.bits, embed_groups=0 if fmt.group_size == PER_TENSOR else
                     fmt.groups_per_row(table.embedding_dim), embed_scale=fmt.scale_dtype,
                     embed_zero=fmt.zero_dtype if fmt.has_zeros else "")
    return GlueSpec(isa.name, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim,
                    cfg.activation, cfg.sub_norms, act_quant, kv_dtype, **embed)


def plan_key(model) -> tuple:
    """What a ``DecodePlan`` holds handles into and reads at build time: the cache, every module, its tensors' memory
    and a LUT projection's kernels. A plan built under another key is stale (a module swapped, a cache set up again).
    Checked once a generation, a fraction of building the plan (docs/decisions.md, "The decode plan")."""
    cache = tuple(None if t is None else (t.data_ptr(), tuple(t.shape), t.dtype)
                  for t in (model.cache_k, model.cache_v, model.cos, model.sin))

    def tensors(m):
        return (*m._parameters.values(), *m._buffers.values())

    return cache, tuple((id(m), *((m.spec, m.kernel_dir) if isinstance(m, Linear) else ()),
                         *(None if t is None else t.data_ptr() for t in tensors(m))) for m in model.modules())


QUANTIZE = {"xn": "quantize_dim", "att": "quantize_q", "att_n": "quantize_q", "hid": "quantize_ffn",
            "hid_n": "quantize_ffn"}  # input buffer → the glue function quantizing it in place


POS, CACHE_K, CACHE_V = (ATTEND_ARGS.index(name) for name in ("pos", "cache_k", "cache_v"))  # what a step sets


def _sequence_handles(sequence) -> list[tuple]:
    if sequence.glue_handles is None:
        sequence.glue_handles = [(_handle(sequence.k[i]), _handle(sequence.v[i])) for i in range(sequence.k.shape[0])]
    return sequence.glue_handles


class DecodePlan:
    """One token's step as a flat list of ``(function, args)`` calls into compiled code (see the module doc)."""

    def __init__(self, model, calls: list, positions: list, buffers: dict, labels: dict, keep: tuple):
        # no reference to the model: a session keeps the model and its plan, and a cycle would leave a deleted
        # model's gigabytes to the cyclic garbage collector
        self.context, self.calls, self.positions = model.context, calls, positions
        self.own_cache = [(args[CACHE_K], args[CACHE_V]) for args in positions]
        self.buf, self.labels = buffers, labels
        emb = model.tok_embeddings
        self.vocab = emb.num_embeddings
        x = buffers["x"][0]  # the step's first input: the token's row (a quantized table's dequantized) lands there
        if isinstance(emb, nn.Embedding):
            self.embed_into = lambda t: x.copy_(emb.weight[t])
        else:
            glue, params = keep[0], [_handle(t) for t in (emb.codes, emb.scales, emb.zeros) if t is not None]
            x_handle = _handle(buffers["x"])
            self.embed_into = lambda t: glue.embed(*params, t, x_handle)
        self._keep = keep  # the glue library and the scratch tensors the handles in ``calls`` point into

    @classmethod
    def build(cls, model) -> "DecodePlan | None":
        """The plan for ``model`` with its current cache, or ``None`` when some part needs the eager path."""
        try:
            return cls._build(model)
        except _Unsupported:
            return None

    @classmethod
    def _build(cls, model) -> "DecodePlan":
        cfg = model.config
        if model.cache_k is None or not isinstance(model.tok_embeddings, (nn.Embedding, Embedding)):
            raise _Unsupported("no cache or another embedding module")
        first = model.layers[0].attention.wqkv
        first = first.linear if isinstance(first, ActivationQuantized) else first
        first = first.parts[0] if isinstance(first, Concat) else first
        if not isinstance(first, Linear):
            raise _Unsupported("float projections")
        isa = isa_by_name(first.spec.isa)
        act_quant = any(isinstance(m, ActivationQuantized) for m in model.modules())
        glue = runtime.load_kernels(glue_spec(cfg, act_quant, isa, model.kv_dtype, model.tok_embeddings), isa)
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        names = {"x": cfg.dim, "delta": cfg.dim, "zero": cfg.dim, "xn": cfg.dim, "qkv": q_dim + 2 * kv_dim,
                 "att": q_dim, "att_n": q_dim, "gu": 2 * cfg.ffn_dim, "hid": cfg.ffn_dim, "hid_n": cfg.ffn_dim,
                 "logits": cfg.vocab_size}
        buf = {name: torch.zeros((1, n)) for name, n in names.items()}
        scores = torch.zeros((cfg.n_heads, model.cache_v.shape[2]))  # the cache's positions, whole key blocks
        tables: dict = {}
        h = {name: _handle(t) for name, t in buf.items()}
        cos, sin, sc = _handle(model.cos), _handle(model.sin), _handle(scores)
        eps = float(cfg.norm_eps)
        calls, positions = [], []
        labels = {id(getattr(glue, name)): name for name in glue.spec.functions}  # id(function) → its name

        def project(module, src: str, dst: str, sub_norm=None, norm_fn=None):
            if cfg.sub_norms and sub_norm is not None:  # BitNet's norm before the output and down projections
                calls.append((norm_fn, [h[src], _norm(sub_norm), eps, h[src + "_n"]]))
                src += "_n"
            if isinstance(module, ActivationQuantized):  # the input is consumed only here: quantize it in place
                calls.append((getattr(glue, QUANTIZE[src]), [h[src]]))
                module = module.linear
            calls.extend(_projection(module, buf[src], buf[dst], tables, labels))

        for i, layer in enumerate(model.layers):
            attn, ffn = layer.attention, layer.feed_forward
            norms = (attn.out_norm, ffn.hidden_norm)
            if ffn.act is not ACTIVATION_FUNCTIONS[cfg.activation] or not all(
                    isinstance(n, RMSNorm if cfg.sub_norms else nn.Identity) for n in norms):
                raise _Unsupported("a layer with other norms or activation")
            named = dict(qkv=h["qkv"], cos=cos, sin=sin, cache_k=_handle(model.cache_k[i]),
                         cache_v=_handle(model.cache_v[i]), scores=sc, pos=0, out=h["att"])
            attend = [named[name] for name in ATTEND_ARGS]
            positions.append(attend)
            calls.append((glue.norm_in, [h["x"], h["zero" if i == 0 else "delta"], _norm(layer.attention_norm), eps,
                                         h["xn"]]))
            project(attn.wqkv, "xn", "qkv")
            calls.append((glue.attend, attend))
            project(attn.wo, "att", "delta", attn.out_norm, getattr(glue, "norm_attn", None))
            calls.append((glue.norm_in, [h["x"], h["delta"], _norm(layer.ffn_norm), eps, h["xn"]]))
            project(ffn.w13, "xn", "gu")
            calls.append((glue.gated_act, [h["gu"], h["hid"]]))
            project(ffn.w2, "hid", "delta", ffn.hidden_norm, getattr(glue, "norm_hidden", None))
        calls.append((glue.norm_final, [h["x"], h["delta"], _norm(model.norm), eps, h["xn"]]))
        project(model.output, "xn", "logits")
        return cls(model, calls, positions, buf, labels, (glue, scores, tables))

    def step(self, token: int, pos: int, sequence=None) -> torch.Tensor:
        """Logits ``[vocab]`` of ``token`` at position ``pos`` of ``sequence`` (a ``Sequence``, whose cache holds
        positions ``< pos``; default: the model's own cache). The returned tensor is the plan's buffer: the next
        step overwrites it."""
        context = self.context if sequence is None else sequence.context
        if not 0 <= pos < context:
            raise ValueError(f"position {pos} is outside the context of {context} tokens")
        if not 0 <= token < self.vocab:
            raise ValueError(f"token id {token} is outside the vocabulary [0, {self.vocab})")
        runtime.apply_threads()
        caches = self.own_cache if sequence is None else _sequence_handles(sequence)
        for args, (keys, values) in zip(self.positions, caches):
            args[POS], args[CACHE_K], args[CACHE_V] = pos, keys, values
        self.embed_into(token)
        for fn, args in self.calls:
            fn(*args)
        return self.buf["logits"][0]

    def profile(self, token: int, pos: int, rounds: int = 5) -> dict[str, float]:
        """Seconds per step in each kind of call (glue function, ``build_tables``, ``lut_gemv``, float projection),
        each call timed in place, from the round whose calls sum lowest; ``"step"``: the fastest untimed step.
        Like ``step``, it writes the KV cache at ``pos``."""
        steps, splits = [], []
        self.step(token, pos)
        for _ in range(rounds):
            t0 = time.perf_counter()
            self.step(token, pos)
            steps.append(time.perf_counter() - t0)
            self.embed_into(token)
            spent: dict[str, float] = {}
            for fn, args in self.calls:
                t0 = time.perf_counter()
                fn(*args)
                spent[self.labels[id(fn)]] = spent.get(self.labels[id(fn)], 0.0) + time.perf_counter() - t0
            splits.append(spent)
        return {"step": min(steps), **min(splits, key=lambda d: sum(d.values()))}


def _norm(norm: nn.Module):
    if not isinstance(norm, RMSNorm) or norm.weight.dtype != torch.float32:
        raise _Unsupported("a norm that is not a float32 RMSNorm")
    return _handle(norm.weight.detach())
