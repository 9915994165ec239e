"""Generate the decode glue of one ``GlueSpec`` (what each function does: ``tmac.base.glue``) as TIR.

The float operations follow the eager model's order (RMSNorm: ``x·rsqrt(mean(x²)+eps)·w``; RoPE then the
``head_dim^-½`` scale; softmax as ``exp(s − max) / Σ``), so the two paths differ only in summation order.
Vectors are ``lanes`` floats (the widest power of two up to the ISA's vector that divides the length); sums
run in vector lanes and are folded once at the end.
"""

from __future__ import annotations

from tmac.base.formats import STORAGE_BITS, code_offset
from tmac.base.glue import ROWS, GlueSpec

from tmac.codegen.attention import attend_func
from tmac.codegen.tir import arg, prim_func
from tmac.codegen.vectors import F32, bcast, exp, f32, lane_fold, lanes_of, rms_scale, vec


def _rows(batched: bool):
    """The row count of a glue function's buffers: 1, or (``batched``, the ``_rows`` variant) a runtime value."""
    from tvm.script.ir_builder import tirx as T

    return T.int32() if batched else 1


def _each_row(rows, body) -> None:
    """``body(row)`` for row 0 of a one-row function, or for every row of a batched one in parallel (each task with
    its own scratch buffers)."""
    from tvm.script.ir_builder import tirx as T

    if isinstance(rows, int):
        body(0)
        return
    with T.parallel(0, rows) as row:
        body(row)


def rms_norm_func(name: str, n: int, widest: int, residual: bool, batched: bool = False, residual_scale: float = 0.0):
    """``out = rmsnorm(x)·w``, after ``x += delta`` (times ``residual_scale`` where it is set) with ``residual``."""
    from tvm.script.ir_builder import tirx as T

    lanes = lanes_of(n, widest)
    with prim_func(name) as ib:
        rows = _rows(batched)
        X = arg("x", (rows, n))
        D = arg("delta", (rows, n)) if residual else None
        W = arg("w", (n,))
        eps = T.arg("eps", T.float32())
        OUT = arg("out", (rows, n))

        def norm(row):
            def square(at):
                if residual:
                    delta = D[row, at] * bcast(f32(residual_scale), lanes) if residual_scale else D[row, at]
                    T.buffer_store(X, X[row, at] + delta, [row, at])
                return X[row, at] * X[row, at]

            scale = rms_scale(T, n, lanes, square, eps)
            with T.serial(0, n // lanes) as c:
                at = vec(c * lanes, lanes)
                T.buffer_store(OUT, X[row, at] * bcast(scale[0], lanes) * W[at], [row, at])

        _each_row(rows, norm)
    return ib.get()


def add_func(name: str, n: int, widest: int, batched: bool = False, residual_scale: float = 0.0):
    """``out = x += delta`` (times ``residual_scale`` where it is set): the residual with no norm after it."""
    from tvm.script.ir_builder import tirx as T

    lanes = lanes_of(n, widest)
    with prim_func(name) as ib:
        rows = _rows(batched)
        X = arg("x", (rows, n))
        D = arg("delta", (rows, n))
        OUT = arg("out", (rows, n))

        def add(row):
            with T.serial(0, n // lanes) as c:
                at = vec(c * lanes, lanes)
                delta = D[row, at] * bcast(f32(residual_scale), lanes) if residual_scale else D[row, at]
                T.buffer_store(X, X[row, at] + delta, [row, at])
                T.buffer_store(OUT, X[row, at], [row, at])

        _each_row(rows, add)
    return ib.get()


def quantize_func(name: str, n: int, widest: int, batched: bool = False):
    """Per-token absmax int8 fake-quantization in place: ``x·s`` rounded half-to-even, clamped, divided back."""
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    lanes = lanes_of(n, widest)
    with prim_func(name) as ib:
        rows = _rows(batched)
        X = arg("x", (rows, n))

        def quantize(row):
            scale = T.alloc_buffer((1,), F32, scope="global")
            amax = lane_fold(T, n, lanes, tirx.max, lambda at: tirx.abs(X[row, at]))
            T.buffer_store(scale, f32(127.0) / tirx.max(amax, f32(1e-5)), [0])
            with T.serial(0, n // lanes) as c:
                at = vec(c * lanes, lanes)
                s = bcast(scale[0], lanes)
                q = tirx.min(tirx.max(tirx.nearbyint(X[row, at] * s), bcast(f32(-128.0), lanes)),
                             bcast(f32(127.0), lanes))
                T.buffer_store(X, q / s, [row, at])

        _each_row(rows, quantize)
    return ib.get()


def gated_act_func(spec: GlueSpec, widest: int, batched: bool = False):
    f = spec.ffn_dim
    lanes = lanes_of(f, widest)
    with prim_func("gated_act" + ROWS * batched) as ib:
        rows = _rows(batched)
        GU = arg("gate_up", (rows, 2 * f))
        OUT = arg("out", (rows, f))
        _each_row(rows, lambda row: _gated_act(spec, f, lanes, GU, OUT, row))
    return ib.get()


def _gated_act(spec: GlueSpec, f: int, lanes: int, GU, OUT, row) -> None:
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    with T.serial(0, f // lanes) as c:
        g, u = GU[row, vec(c * lanes, lanes)], GU[row, vec(f + c * lanes, lanes)]
        one = bcast(f32(1.0), lanes)
        if spec.act == "silu":
            a = g / (one + exp(bcast(f32(0.0), lanes) - g, lanes))
        elif spec.act == "gelu_tanh":  # ½g(1 + tanh(√(2/π)(g + 0.044715g³))), tanh(y) = 1 − 2/(e^2y + 1)
            two_y = bcast(f32(2 * 0.7978845608028654), lanes) * (g + bcast(f32(0.044715), lanes) * g * g * g)
            a = bcast(f32(0.5), lanes) * g * (one + one - bcast(f32(2.0), lanes) / (exp(two_y, lanes) + one))
        else:  # relu2
            r = tirx.max(g, bcast(f32(0.0), lanes))
            a = r * r
        T.buffer_store(OUT, a * u, [row, vec(c * lanes, lanes)])


def embed_func(spec: GlueSpec):
    """Row ``token`` of the token table (``tmac.Embedding``'s storage: codes bit-packed row-major, ``8 / slot`` to a
    byte, low bits first) as ``(q − offset)·s − z`` in float32, the operations and order of ``Embedding.row``."""
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    d, bits, groups = spec.dim, spec.embed_bits, spec.embed_groups
    slot = STORAGE_BITS[bits]
    per_byte, mask, offset = 8 // slot, (1 << slot) - 1, code_offset(bits)
    with prim_func("embed") as ib:
        vocab = T.int32()
        C = arg("codes", (vocab, d // per_byte), "uint8")
        S = arg("scales", (vocab, groups) if groups else (1, 1), spec.embed_scale)
        Z = arg("zeros", (vocab, groups) if groups else (1, 1), spec.embed_zero) if spec.embed_zero else None
        token = T.arg("token", T.int32())
        OUT = arg("out", (1, d))
        with T.Assert(tirx.all(0 <= token, token < vocab), "embed: token id outside the table", "ValueError"):
            with T.serial(0, d) as i:
                q = (C[token, i // per_byte] >> tirx.Cast("uint8", i % per_byte * slot)) & tirx.IntImm("uint8", mask)
                at = (token, i // (d // groups)) if groups else (0, 0)
                w = (tirx.Cast(F32, q) - f32(float(offset))) * tirx.Cast(F32, S[at])
                if Z is not None:
                    w = w - tirx.Cast(F32, Z[at])
                T.buffer_store(OUT, w, [0, i])
    return ib.get()


def embed_q8_0_func(spec: GlueSpec):
    """Row ``token`` of a GGUF Q8_0 table read from its own blocks (34 bytes: a float16 scale, 32 int8 codes) as
    ``code·scale`` in float32: ``gguf.quants.dequantize``'s row, bit for bit."""
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    d = spec.dim
    row = d // 32 * 34
    with prim_func("embed") as ib:
        vocab = T.int32()
        B = arg("blocks", (vocab, row), "uint8")
        token = T.arg("token", T.int32())
        OUT = arg("out", (1, d))
        codes = T.decl_buffer((vocab * row,), "int8", data=B.data)
        halves = T.decl_buffer((vocab * row // 2,), "float16", data=B.data)  # (blocks start 2-byte aligned)
        with T.Assert(tirx.all(0 <= token, token < vocab), "embed: token id outside the table", "ValueError"):
            with T.serial(0, d // 32) as g:
                at = token * row + g * 34
                scale = tirx.Cast(F32, halves[at // 2])
                with T.vectorized(0, 32) as i:
                    T.buffer_store(OUT, tirx.Cast(F32, codes[at + 2 + i]) * scale, [0, g * 32 + i])
    return ib.get()


def module(spec: GlueSpec, isa):
    """The IRModule of ``spec``'s glue functions."""
    import tvm

    widest = max(isa.vector_bytes // 4, 4)
    q_dim = spec.n_heads * spec.head_dim
    residual = spec.residual_scale
    funcs = {"norm_final": rms_norm_func("norm_final", spec.dim, widest, True, residual_scale=residual),
             "attend": attend_func(spec, widest, isa.sum_vectors),
             "attend" + ROWS: attend_func(spec, widest, isa.sum_vectors, batched=True)}
    for batched in (False, True):  # each function of one row, and its _rows variant
        suffix = ROWS * batched
        if spec.pre_norms:
            funcs["norm_in" + suffix] = rms_norm_func("norm_in" + suffix, spec.dim, widest, True, batched, residual)
        else:
            funcs["add_in" + suffix] = add_func("add_in" + suffix, spec.dim, widest, batched, residual)
        funcs["gated_act" + suffix] = gated_act_func(spec, widest, batched)
        if spec.post_norms:
            for name in ("norm_post_attn", "norm_post_ffn"):
                funcs[name + suffix] = rms_norm_func(name + suffix, spec.dim, widest, False, batched)
        if spec.sub_norms:
            funcs["norm_attn" + suffix] = rms_norm_func("norm_attn" + suffix, q_dim, widest, False, batched)
            funcs["norm_hidden" + suffix] = rms_norm_func("norm_hidden" + suffix, spec.ffn_dim, widest, False,
                                                          batched)
        if spec.act_quant:
            for name, n in (("dim", spec.dim), ("q", q_dim), ("ffn", spec.ffn_dim)):
                funcs[f"quantize_{name}{suffix}"] = quantize_func(f"quantize_{name}{suffix}", n, widest, batched)
    if spec.qk_norm_whole:  # in place: each element is read before it is written
        funcs["norm_q"] = rms_norm_func("norm_q", q_dim, widest, False)
        funcs["norm_k"] = rms_norm_func("norm_k", spec.n_kv_heads * spec.head_dim, widest, False)
    if spec.embed_bits:
        funcs["embed"] = embed_func(spec)
    elif spec.embed_blocks:
        funcs["embed"] = embed_q8_0_func(spec)
    return tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
