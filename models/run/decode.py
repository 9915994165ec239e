"""The static decode path: one token through the model with no torch op and no allocation per layer.

``DecodePlan.build(model)`` resolves, once per generation, every tensor a step touches into a handle the
compiled code takes directly: the packed weights of each LUT projection, the preallocated activations, table
buffers and KV cache. A layer is then three or four glue-kernel calls (``tmac.base.glue``) and one kernel call per
projection, straight from Python. What the plan cannot run (a float projection, a module it does not know)
makes ``build`` return ``None`` and generation stays on the eager ``forward``; a float part of a projection
(e.g. an unquantized head) runs as one ``torch.mm`` into its slice of the output.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
from torch import nn

from tmac.execution import runtime
from tmac.models.run.calls import PREFILL_ROWS_KEPT, CallPlan, prefill_rows
from tmac.quant.embedding import Embedding, StreamedEmbedding
from tmac.base.float_linear import FLOAT_LINEARS, FloatLinear
from tmac.base.formats import PER_TENSOR
from tmac.base.glue import EMBED_BLOCKS, ROWS, GlueSpec
from tmac.kernels import isa_by_name
from tmac.nn.linear import Linear
from tmac.execution.lut_ops import (check_packed, dot_buffers, dot_padded_rows, kernels_for, table_buffers,
                                    takes_dot_products)
from tmac.quant.spec import PARALLEL_TABLE_ROWS

from tmac.models.family.bitnet import ActivationQuantized
from tmac.models.family.llama import ACTIVATION_FUNCTIONS, Concat, RMSNorm


class _Unsupported(Exception):
    pass


_made: dict | None = None  # while a plan is built: each handle's id → its tensor (``DecodePlan.tensors``)


def _handle(t: torch.Tensor):
    """A zero-copy tvm_ffi view: passing it skips the per-call DLPack conversion of a torch tensor."""
    handle = runtime.ffi().from_dlpack(t)
    if _made is not None:
        _made[id(handle)] = t
    return handle


def _projection(module: nn.Module, x: torch.Tensor, out: torch.Tensor, tables: dict, labels: dict,
                biased: bool = False, hold: bool = False, dot: bool = False, scratch: list | None = None) -> list:
    """The calls computing ``out = x @ Wᵀ`` for one fused projection: LUT parts one ``lut_gemv`` (tables and
    GEMV in one call), float parts one ``torch.mm``, each into its column slice of ``out`` (contiguous: one row).
    Several rows: the tables of all, then one ``lut_gemm`` reading each weight once for all of them (a row's
    result is the GEMV's, bit for bit). A column slice of several rows is not contiguous: where a projection has
    several parts (llama.cpp's mixes: a Q6_K v beside Q4_K q and k), each writes its own rows, then copied in.
    ``biased``: the projection's bias is added by the glue that reads ``out`` (``attend``: the q/k/v biases).
    ``hold``: the kernels keep the GIL (``KernelLibrary.holding_gil``). ``dot``: a prefill's rows, which take the
    dot-product GEMM where the spec has one (``takes_dot_products``; a decode step's rows never do: a sequence's
    tokens do not change with the batch it is stepped in). ``scratch``: gets the buffers made here."""
    parts = list(module.parts) if isinstance(module, Concat) else [module]
    rows = x.shape[0]
    calls, start = [], 0
    for part in parts:
        m = part.out_features
        slice_ = out[:, start:start + m]
        dest = slice_ if rows == 1 or len(parts) == 1 else torch.empty((rows, m))
        if dest is not slice_ and scratch is not None:
            scratch.append(dest)
        if part.bias is not None and not biased:
            raise _Unsupported(f"a projection with a bias ({type(part).__name__})")
        if isinstance(part, Linear):
            spec = part.spec
            check_packed(spec, m, part.qweight, part.scales, part.zeros, part.bias)
            kernels = kernels_for(spec, part.kernel_dir)
            kernels = kernels.holding_gil if hold else kernels
            table_rows = 1 if rows == 1 else spec.padded_rows(rows)
            key = spec.table_shapes(table_rows)
            if key not in tables:
                tables[key] = table_buffers(spec, table_rows)
            lut = [_handle(t) for t in tables[key]]
            params = [_handle(t) for t in (part.qweight, part.scales, part.zeros) if t is not None]
            if rows == 1:
                calls.append((kernels.lut_gemv, [_handle(x), *params, *lut, _handle(dest)]))
                labels[id(kernels.lut_gemv)] = "lut_gemv (tables included)"
            elif dot and takes_dot_products(spec, rows, prefill=True):
                padded = dot_padded_rows(spec, rows)
                key = ("dot", spec.k, spec.group_size, spec.activation_block, padded)
                if key not in tables:
                    tables[key] = dot_buffers(spec, padded)
                acts = [_handle(t) for t in tables[key]]
                calls += [(kernels.quantize_rows, [_handle(x), *acts]),
                          (kernels.dot_gemm, [*params, *acts, _handle(dest)])]
                labels.update({id(kernels.quantize_rows): "quantize_rows", id(kernels.dot_gemm): "dot_gemm"})
            else:
                calls += [(kernels.build_tables, [_handle(x), *lut]),
                          (kernels.lut_gemm, [*params, *lut, _handle(dest)])]
                labels.update({id(kernels.build_tables): "build_tables", id(kernels.lut_gemm): "lut_gemm"})
        elif type(part) in FLOAT_LINEARS and part.weight.dtype == torch.float32:
            calls.append((functools.partial(torch.mm, out=dest), [x, part.weight.detach().t()]))
            labels[id(calls[-1][0])] = "float projection (torch.mm)"
        elif type(part) is FloatLinear and part.weight.dtype in (torch.float16, torch.bfloat16):
            w = part.weight.detach()  # 16-bit: the input rounded to its dtype, the output widened (FloatLinear)
            x16, y16 = torch.empty(x.shape, dtype=w.dtype), torch.empty(dest.shape, dtype=w.dtype)
            calls += [(x16.copy_, [x]), (functools.partial(torch.mm, out=y16), [x16, w.t()]), (dest.copy_, [y16])]
            labels.update({id(fn): "float projection (torch.mm)" for fn, _ in calls[-3:]})
        else:
            raise _Unsupported(f"projection part {type(part).__name__}")
        if dest is not slice_:
            calls.append((slice_.copy_, [dest]))
            labels[id(calls[-1][0])] = "a projection's parts copied together"
        start += m
    if start != out.shape[1]:
        raise _Unsupported("projection widths do not add up")
    return calls


# What the plan was taught, in one block: each config field the plan computes → the ``GlueSpec`` fields the glue
# takes it as (a function of the config each), or ``{}`` where the plan's own calls compute it (the embedding's
# scale, the logits' divisor and cap) or the model's modules and tables do (sizes, RoPE's tables, a layer's window).
# ``glue_spec`` is made from it and ``untaught`` refuses every other field away from its default: a new variation
# runs on the eager path (never on wrong numbers) until it has a row here.
TAUGHT = {
    **dict.fromkeys(("vocab_size", "n_layers", "norm_eps", "context_length", "tie_embeddings", "arch", "embed_scale",
                     "final_softcap", "logit_scale", "sliding_layers", "rope_theta", "rope_scaling", "rope_factors",
                     "rope_factors_long", "rope_original_context", "rope_attn_factor", "rope_local_theta",
                     "nope_layers"), {}),
    "dim": {"dim": lambda c: c.dim}, "n_heads": {"n_heads": lambda c: c.n_heads},
    "n_kv_heads": {"n_kv_heads": lambda c: c.n_kv_heads}, "head_dim": {"head_dim": lambda c: c.head_dim},
    "ffn_dim": {"ffn_dim": lambda c: c.ffn_dim}, "activation": {"act": lambda c: c.activation},
    "sub_norms": {"sub_norms": lambda c: c.sub_norms}, "qkv_bias": {"qkv_bias": lambda c: c.qkv_bias},
    "qk_norm": {"qk_norm": lambda c: c.qk_norm and not c.qk_norm_whole},  # (per head, inside attend)
    "qk_norm_whole": {"qk_norm_whole": lambda c: c.qk_norm_whole}, "pre_norms": {"pre_norms": lambda c: c.pre_norms},
    "post_norms": {"post_norms": lambda c: c.post_norms},
    "rotary_dim": {"rotary_dim": lambda c: c.rotary_dim},  # (the glue spec reads all of a head as 0)
    # (head_dim^-½ is every other model's kernel)
    "attn_scale": {"attn_scale": lambda c: 0.0 if c.attn_scale in (0.0, c.head_dim ** -0.5) else c.attn_scale},
    "sliding_window": {"window": lambda c: bool(c.sliding_window)}, "attn_softcap": {"softcap": lambda c: c.attn_softcap},
    "residual_scale": {"residual_scale": lambda c: 0.0 if c.residual_scale == 1.0 else c.residual_scale},
}


def glue_spec(cfg, act_quant: bool, isa, kv_dtype: str = "float16", table=None, held: bool = False) -> GlueSpec:
    """The glue kernels a model of config ``cfg`` (with int8 activations in front of some projections with
    ``act_quant``) decodes with on ``isa``, with a KV cache of ``kv_dtype`` and the token table module ``table`` (a
    quantized one gets its lookup compiled; ``held``: a file's table as a ``.tmac`` file holds it): the config's
    part read through ``TAUGHT``."""
    embed = {}
    if isinstance(table, StreamedEmbedding) and not held:  # its own blocks, where the glue reads their type
        embed = dict(embed_blocks=table.blocks_type) if table.blocks_type in EMBED_BLOCKS[1:] else {}
    elif isinstance(table, Embedding) and table.format.codebook is None:  # (a codebook's rows: looked up in Python)
        fmt = table.format
        embed = dict(embed_bits=fmt.bits, embed_groups=0 if fmt.group_size == PER_TENSOR else
                     fmt.groups_per_row(table.embedding_dim), embed_scale=fmt.scale_dtype,
                     embed_zero=fmt.zero_dtype if fmt.has_zeros else "")
    taught = {name: value(cfg) for fields in TAUGHT.values() for name, value in fields.items()}
    return GlueSpec(isa=isa.name, act_quant=act_quant, kv_dtype=kv_dtype, **embed, **taught)


def untaught(cfg) -> list[str]:
    """The fields of ``cfg`` that change the model's computation and that the plan was not taught (``TAUGHT``)."""
    return [f.name for f in dataclasses.fields(cfg) if f.name not in TAUGHT and getattr(cfg, f.name) != (
        f.default if f.default is not dataclasses.MISSING else f.default_factory())]


def plan_key(model) -> tuple:
    """What a ``DecodePlan`` holds handles into and reads at build time: the cache, every module, its tensors' memory
    and a LUT projection's kernels. A plan built under another key is stale (a module swapped, a cache set up again).
    Checked once a generation, a fraction of building the plan (docs/decisions.md, "The decode plan")."""
    cache = tuple(None if t is None else (t.data_ptr(), tuple(t.shape), t.dtype)
                  for t in (model.cache_k, model.cache_v, model.cos, model.sin, model.cos_local, model.sin_local,
                            model.cos_none, model.sin_none))

    def tensors(m):
        return (*m._parameters.values(), *m._buffers.values())

    return cache, tuple((id(m), *((m.spec, m.kernel_dir) if isinstance(m, Linear) else ()),
                         *(None if t is None else t.data_ptr() for t in tensors(m))) for m in model.modules())


QUANTIZE = {"xn": "quantize_dim", "att": "quantize_q", "att_n": "quantize_q", "hid": "quantize_ffn",
            "hid_n": "quantize_ffn"}  # input buffer → the glue function quantizing it in place


def _sequence_handles(sequence) -> list[tuple]:
    if sequence.glue_handles is None:
        sequence.glue_handles = [(_handle(sequence.k[i]), _handle(sequence.v[i])) for i in range(sequence.k.shape[0])]
    return sequence.glue_handles


class DecodePlan(CallPlan):
    """One token's step as a flat list of ``(function, args)`` calls into compiled code (see the module doc), built
    from a model. ``tensors``: the tensor behind each handle the calls take (by the handle's id), and ``scratch``
    the plan's own buffers, for ``tmac.models.run.recipe`` to write the plan down."""

    def __init__(self, model, calls: list, positions: list, buffers: dict, labels: dict, keep: tuple,
                 tensors: dict, scratch: list, prefill: bool):
        # no reference to the model: a session keeps the model and its plan, and a cycle would leave a deleted
        # model's gigabytes to the cyclic garbage collector
        self.context, self.calls = model.context, calls
        self.rows_positions = positions  # per row, per layer: the attend call's arguments
        self.rows = len(positions)
        self.glue_spec = keep[0].spec
        names = self.glue_spec.attend_args
        self.slots = tuple(names.index(name) for name in ("pos", "cache_k", "cache_v"))  # what a step sets
        self.own_cache = [(args[self.slots[1]], args[self.slots[2]]) for args in positions[0]]
        self.buf, self.labels = buffers, labels
        emb = model.tok_embeddings
        self.vocab = emb.num_embeddings
        self.tensors, self.scratch, self.prefill_plan = tensors, scratch, prefill
        self.embed_rows = [self._embedder(model, buffers["x"][r:r + 1], keep[0]) for r in range(self.rows)]
        self.embed_into = self.embed_rows[0]
        self._keep = keep  # the glue library and the scratch tensors the handles in ``calls`` point into

    @staticmethod
    def _embedder(model, x: torch.Tensor, glue):
        """A function writing token ``t``'s row into ``x [1, dim]`` (the step's first input; a quantized table's
        row dequantized)."""
        emb, row = model.tok_embeddings, x[0]
        recipe = None  # how ``tmac.models.run.recipe`` writes it down: a glue call's arguments, the token's between
        if isinstance(emb, nn.Embedding):
            embed = lambda t: row.copy_(emb.weight[t])  # noqa: E731
            recipe = ("row", emb.weight.detach(), row)
        elif isinstance(emb, StreamedEmbedding) and glue.spec.embed_blocks:  # the row read from the file's blocks
            blocks = _handle(emb.blocks)
            x_handle = _handle(x)
            embed = lambda t: glue.embed(blocks, t, x_handle)  # noqa: E731
        elif isinstance(emb, StreamedEmbedding) or emb.format.codebook is not None:  # blocks or levels the glue
            embed = lambda t: row.copy_(emb.row(t))  # noqa: E731                      does not read: in Python
        else:
            params = [emb.codes, emb.scales, emb.zeros]
            handles = [_handle(t) for t in params if t is not None]
            x_handle = _handle(x)
            embed = lambda t: glue.embed(*handles, t, x_handle)  # noqa: E731
            recipe = ("embed", [t for t in params if t is not None], x)
        scale = model.config.embed_scale
        if scale != 1.0:  # Gemma: × √dim
            embed, recipe = (lambda t, plain=embed: (plain(t), row.mul_(scale))), None
        embed.recipe = recipe
        return embed

    @classmethod
    def build(cls, model, rows: int = 1, prefill: bool = False) -> "DecodePlan | None":
        """The plan for ``model`` with its current cache, or ``None`` when some part needs the eager path.
        ``rows``: sequences a step serves (``step_rows``), each with its own token, position and cache: the glue
        row by row, each projection once for all. ``prefill``: the rows are consecutive positions of one sequence
        (``prefill``), and the head runs on the last row alone."""
        global _made
        _made = {}
        try:
            return cls._build(model, rows, prefill)
        except _Unsupported:
            return None
        finally:
            _made = None

    @classmethod
    def _build(cls, model, rows: int = 1, prefill: bool = False) -> "DecodePlan":
        cfg = model.config
        fields = untaught(cfg)
        if fields:
            warnings.warn(f"the decode plan does not compute {', '.join(fields)} of this {cfg.arch} model: it runs "
                          f"on the eager path (slower, same numbers)", stacklevel=4)
            raise _Unsupported(f"untaught variations {fields}")
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
        # a step's calls are short, and one thread makes them: they keep the GIL (a server's other threads take it
        # between calls); a prefill's GEMMs run long and give it away
        hold = not prefill
        glue = glue.holding_gil if hold else glue
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        names = {"x": cfg.dim, "delta": cfg.dim, "post": cfg.dim, "zero": cfg.dim, "xn": cfg.dim,
                 "qkv": q_dim + 2 * kv_dim,
                 "att": q_dim, "att_n": q_dim, "gu": 2 * cfg.ffn_dim, "hid": cfg.ffn_dim, "hid_n": cfg.ffn_dim,
                 "logits": cfg.vocab_size}
        buf = {name: torch.zeros((1 if prefill and name == "logits" else rows, n)) for name, n in names.items()}
        scores = torch.zeros((cfg.n_heads, model.cache_v.shape[2]))  # the cache's positions, whole key blocks
        # attend_rows's: one scratch a task, a task a CPU this process may use
        task_scores = torch.zeros((runtime.usable_cpus(), *scores.shape) if prefill and rows >= PARALLEL_TABLE_ROWS
                                  else (0,))
        tables: dict = {}
        scratch: list = []  # buffers _projection makes
        row_handles = [{name: _handle(t[r:r + 1]) for name, t in buf.items()} for r in range(rows)]
        sc = _handle(scores)
        ropes = {}  # id(cos table) → the handles of (cos, sin)
        eps = float(cfg.norm_eps)
        calls, positions = [], [[] for _ in range(rows)]
        labels = {id(getattr(glue, name)): name for name in glue.spec.functions}  # id(function) → its name

        biases = []  # the q/k/v biases attend adds, as one row each

        whole = {name: _handle(t) for name, t in buf.items()}

        def each_row(fn, *args) -> None:
            """A glue call on every row: ``args`` are buffer names, or values passed as they are. From
            ``PARALLEL_TABLE_ROWS`` rows, one call of the function's ``_rows`` variant where it has one, the rows
            on the pool."""
            if rows >= PARALLEL_TABLE_ROWS and labels[id(fn)] in glue.spec.row_functions:
                calls.append((getattr(glue, labels[id(fn)] + ROWS), [whole.get(a, a) if isinstance(a, str) else a
                                                                     for a in args]))
                return
            for h in row_handles:
                calls.append((fn, [h[a] if isinstance(a, str) else a for a in args]))

        def project(module, src: str, dst: str, sub_norm=None, norm_fn=None, biased=False, last=False):
            """``dst = src @ Wᵀ``, of the last row alone with ``last``."""
            if cfg.sub_norms and sub_norm is not None:  # BitNet's norm before the output and down projections
                each_row(norm_fn, src, _norm(sub_norm), eps, src + "_n")
                src += "_n"
            if isinstance(module, ActivationQuantized):  # the input is consumed only here: quantize it in place
                quantize = getattr(glue, QUANTIZE[src])
                if last:
                    calls.append((quantize, [row_handles[-1][src]]))
                else:
                    each_row(quantize, src)
                module = module.linear
            calls.extend(_projection(module, buf[src][-1:] if last else buf[src], buf[dst], tables, labels, biased,
                                     hold, dot=prefill, scratch=scratch))

        def post_norm(fn, norm) -> str:
            """The buffer the residual adds: the projection's output, or Gemma's norm of it."""
            if not cfg.post_norms:
                return "delta"
            each_row(fn, "delta", _norm(norm), eps, "post")
            return "post"

        def norm_in(norm, residual: str) -> None:
            """``x += residual``, then ``xn`` its norm (without input norms, OLMo 2's: ``x`` itself)."""
            if cfg.pre_norms:
                each_row(glue.norm_in, "x", residual, _norm(norm), eps, "xn")
            else:
                each_row(glue.add_in, "x", residual, "xn")

        residual = "zero"
        for i, layer in enumerate(model.layers):
            attn, ffn = layer.attention, layer.feed_forward
            _check_layer(cfg, layer)
            cos, sin = model.rope(i)
            if id(cos) not in ropes:
                ropes[id(cos)] = (_handle(cos), _handle(sin))
            shared = dict(cos=ropes[id(cos)][0], sin=ropes[id(cos)][1], cache_k=_handle(model.cache_k[i]),
                          cache_v=_handle(model.cache_v[i]), scores=sc, pos=0, window=attn.window)
            if cfg.qkv_bias:
                biases.append(_qkv_bias(attn.wqkv))
                shared["bias"] = _handle(biases[-1])
            if cfg.qk_norm and not cfg.qk_norm_whole:
                shared.update(q_norm=_norm(attn.q_norm), k_norm=_norm(attn.k_norm), eps=eps)
            norm_in(layer.attention_norm, residual)
            project(attn.wqkv, "xn", "qkv", biased=cfg.qkv_bias)
            if cfg.qk_norm_whole:  # OLMo 2: q and k each normalized whole, in place, before attend turns them
                q_norm, k_norm = _norm(attn.q_norm), _norm(attn.k_norm)
                for qkv in buf["qkv"].split(1):
                    q, k = _handle(qkv[:, :q_dim]), _handle(qkv[:, q_dim:q_dim + kv_dim])
                    calls += [(glue.norm_q, [q, q_norm, eps, q]), (glue.norm_k, [k, k_norm, eps, k])]
            if prefill and rows >= PARALLEL_TABLE_ROWS:  # the rows' attention in one call, on the pool
                named = dict(shared, qkv=whole["qkv"], out=whole["att"], last=rows - 1,
                             scores=_handle(task_scores))
                positions[0].append([named[name] for name in glue.spec.attend_rows_args])
                calls.append((getattr(glue, "attend" + ROWS), positions[0][-1]))
            else:
                for r, h in enumerate(row_handles):  # each row's attention: its own position and cache (set by a step)
                    named = dict(shared, qkv=h["qkv"], out=h["att"])
                    positions[r].append([named[name] for name in glue.spec.attend_args])
                    calls.append((glue.attend, positions[r][-1]))
            project(attn.wo, "att", "delta", attn.out_norm, getattr(glue, "norm_attn", None))
            residual = post_norm(getattr(glue, "norm_post_attn", None), layer.post_attention_norm)
            norm_in(layer.ffn_norm, residual)
            project(ffn.w13, "xn", "gu")
            each_row(glue.gated_act, "gu", "hid")
            project(ffn.w2, "hid", "delta", ffn.hidden_norm, getattr(glue, "norm_hidden", None))
            residual = post_norm(getattr(glue, "norm_post_ffn", None), layer.post_ffn_norm)
        if prefill:  # only the last position's logits
            last = row_handles[-1]
            calls.append((glue.norm_final, [last["x"], last[residual], _norm(model.norm), eps, last["xn"]]))
            project(model.output, "xn", "logits", last=True)
        else:
            each_row(glue.norm_final, "x", residual, _norm(model.norm), eps, "xn")
            project(model.output, "xn", "logits")
        if cfg.logit_scale != 1.0:  # Granite's logits divided, in place
            calls.append((buf["logits"].div_, [cfg.logit_scale]))
            labels[id(calls[-1][0])] = "logit scale"
        if cfg.final_softcap:  # Gemma 2's capped logits: c·tanh(l/c), in place
            cap, logits = cfg.final_softcap, buf["logits"]
            calls += [(logits.div_, [cap]), (torch.tanh_, [logits]), (logits.mul_, [cap])]
            labels.update({id(fn): "logit soft cap" for fn, _ in calls[-3:]})
        scratch += [*buf.values(), scores, task_scores, *(t for kept in tables.values() for t in kept)]
        return cls(model, calls, positions, buf, labels, (glue, scores, tables, biases, task_scores), _made, scratch,
                   prefill)

    def sequence_handles(self, sequence) -> list[tuple]:
        return _sequence_handles(sequence)


def plan_functions(model, plans: list) -> dict:
    """Every kernel function ``plans`` of ``model`` may call, by id: ``(spec, name, holding the GIL)`` (what
    ``tmac.models.run.recipe`` names a call by)."""
    libraries = [kernels_for(m.spec, m.kernel_dir) for m in model.modules() if isinstance(m, Linear)]
    libraries += [runtime.load_kernels(plan._keep[0].spec, isa_by_name(plan._keep[0].spec.isa)) for plan in plans]
    out = {}
    for lib in libraries:
        for hold, variant in ((False, lib), (True, lib.holding_gil)):
            for name in lib.spec.functions:
                out[id(getattr(variant, name))] = (lib.spec, name, hold)
    return out


def multiplies(model) -> bool:
    """Whether a prompt's rows take dot products in some projection of ``model`` (``takes_dot_products``): its
    prefill's numbers are then not a token-by-token decode's bit for bit."""
    return any(takes_dot_products(m.spec, 2, prefill=True) for m in model.modules() if isinstance(m, Linear))


class Plans:
    """The plans of one model, built on first need and kept while its modules, tensors and cache stay the ones they
    were built from (``plan_key``, checked by ``current``): a decode plan per row count, and the prefill plans last
    used (``prefill_rows``), as many as fit ``PREFILL_ROWS_KEPT`` rows. A plan the model cannot have is ``None``."""

    def __init__(self, model):
        self.model = model
        self._key = None
        self._decode: dict = {}
        self._prefill: dict = {}

    def current(self) -> "Plans":
        key = plan_key(self.model)
        if key != self._key:
            self._key, self._decode, self._prefill = key, {}, {}
        return self

    def decode(self, rows: int = 1) -> DecodePlan | None:
        if rows not in self._decode:
            self._decode[rows] = DecodePlan.build(self.model, rows)
        return self._decode[rows]

    def prefill(self, tokens: int) -> DecodePlan | None:
        """The plan that prefills ``tokens`` tokens at once (one token: the one-row decode plan, unless a prompt's
        rows take dot products: then every prompt token does, whatever the chunk it comes in)."""
        if tokens == 1 and not multiplies(self.model):
            return self.decode(1)
        rows = prefill_rows(tokens)
        plan = self._prefill.pop(rows, None) if rows in self._prefill else DecodePlan.build(self.model, rows, True)
        self._prefill[rows] = plan  # the most recent last
        while sum(self._prefill) > max(rows, PREFILL_ROWS_KEPT):
            del self._prefill[next(iter(self._prefill))]
        return plan


def _check_layer(cfg, layer) -> None:
    """The layer is what the config says (the plan derives its calls from the config): its activation, and each
    optional norm there exactly when the config has it."""
    attn, ffn = layer.attention, layer.feed_forward
    optional = ((attn.out_norm, cfg.sub_norms), (ffn.hidden_norm, cfg.sub_norms), (attn.q_norm, cfg.qk_norm),
                (attn.k_norm, cfg.qk_norm), (layer.post_attention_norm, cfg.post_norms),
                (layer.post_ffn_norm, cfg.post_norms), (layer.attention_norm, cfg.pre_norms),
                (layer.ffn_norm, cfg.pre_norms))
    if ffn.act is not ACTIVATION_FUNCTIONS[cfg.activation] or not all(
            isinstance(n, RMSNorm if present else nn.Identity) for n, present in optional):
        raise _Unsupported("a layer with other norms or activation")


def _qkv_bias(module: nn.Module) -> torch.Tensor:
    """The fused q/k/v projection's bias as one float32 row (its parts' biases, concatenated)."""
    module = module.linear if isinstance(module, ActivationQuantized) else module
    parts = list(module.parts) if isinstance(module, Concat) else [module]
    if any(getattr(p, "bias", None) is None for p in parts):
        raise _Unsupported("a q/k/v projection without its bias")
    return torch.cat([p.bias.detach().float() for p in parts]).contiguous()[None]


def _norm(norm: nn.Module):
    if not isinstance(norm, RMSNorm) or norm.weight.dtype != torch.float32:
        raise _Unsupported("a norm that is not a float32 RMSNorm")
    return _handle(norm.weight.detach())
