"""Generate the decode glue of one ``GlueSpec`` (what each function does: ``tmac.glue``) as TIR.

The float operations follow the eager model's order (RMSNorm: ``x·rsqrt(mean(x²)+eps)·w``; RoPE then the
``head_dim^-½`` scale; softmax as ``exp(s − max) / Σ``), so the two paths differ only in summation order.
Vectors are ``lanes`` floats (the widest power of two up to the ISA's vector that divides the length); sums
run in vector lanes and are folded once at the end.
"""

from __future__ import annotations

from tmac.formats import STORAGE_BITS, code_offset
from tmac.glue import KV_BLOCK, GlueSpec

from .tir import arg, prim_func

F32 = "float32"


# TVM keeps a scratch buffer smaller than this on the stack; a larger one comes from its workspace allocator, memory
# LLVM cannot tell from the arguments, so an accumulator kept there is stored back on every loop iteration
STACK_BYTES = 1024
# query-key products (positions × heads × head_dim) from which attention's phases run in parallel: from position
# 170 for SmolLM2's 9 heads of 64, 47 for the 1B shape's 32
PARALLEL_ATTENTION_WORK = 96 * 1024


def _heads_per_pass(group: int, vectors_per_head: int, sums: int, floats_per_buffer: int = 0) -> int:
    """The most heads of a kv head's group (a divisor of it) whose running sums, ``vectors_per_head`` vectors a
    head, fit ``sums`` registers (``Isa.sum_vectors``), and a buffer of ``floats_per_buffer`` floats a head the
    stack."""
    fits = [d for d in range(2, group + 1) if group % d == 0 and d * vectors_per_head <= sums
            and d * floats_per_buffer * 4 < STACK_BYTES]
    return max(fits, default=1)


def _lanes(n: int, widest: int) -> int:
    lanes = widest
    while n % lanes:
        lanes //= 2
    return lanes


def _spans(n: int, widest: int) -> list[tuple[int, int]]:
    """(offset, lanes) vectors covering ``n`` floats: full ``widest``-lane vectors, then a power-of-two tail."""
    spans, at = [], 0
    lanes = widest
    while at < n:
        while lanes > n - at:
            lanes //= 2
        spans.append((at, lanes))
        at += lanes
    return spans


def _fold(v, lanes: int, op):
    """One value from the ``lanes`` lanes of ``v``, halving with shuffles."""
    from tvm import tirx

    while lanes > 1:
        half = lanes // 2
        v = op(tirx.Shuffle([v], list(range(half))), tirx.Shuffle([v], list(range(half, lanes))))
        lanes = half
    return v


def _f(value: float):
    from tvm import tirx

    return tirx.FloatImm(F32, value)


def _bcast(value, lanes: int):
    from tvm import tirx

    return value if lanes == 1 else tirx.Broadcast(value, lanes)


def _exp(x, lanes: int):
    """e^x in float32 without libm, which LLVM would call once per lane (8192 scalar expf calls made SiLU 3 % of a
    1B decode step): 2^n·p(r) with n = round(x·log2 e), r = x − n·ln 2 (|r| ≤ ½ln 2, ln 2 split in two so r is
    exact to float32), p the Taylor polynomial of degree 7 (truncation error r^8/8! < 6e-9 relative). x is
    clamped to [−87, 88]: 2^n stays a normal float, so e^x saturates to ≈ 1.6e-38 and 1.7e38 outside."""
    from tvm import tirx

    def c(v):
        return _bcast(_f(v), lanes)

    x = tirx.min(tirx.max(x, c(-87.0)), c(88.0))
    n = tirx.floor(x * c(1.4426950408889634) + c(0.5))
    r = (x - n * c(0.693145751953125)) - n * c(1.4286068203094172e-06)
    p = c(1.0 / 5040)
    for k in (720, 120, 24, 6, 2, 1, 1):
        p = p * r + c(1.0 / k)
    i32 = "int32" if lanes == 1 else f"int32x{lanes}"
    two_n = tirx.reinterpret(F32 if lanes == 1 else f"float32x{lanes}",
                             (tirx.Cast(i32, n) + _bcast(tirx.IntImm("int32", 127), lanes))
                             << _bcast(tirx.IntImm("int32", 23), lanes))
    return p * two_n


def _vec(start, lanes: int):
    from tvm import tirx

    return tirx.Ramp(start, 1, lanes) if lanes > 1 else start


def _lane_fold(T, n, lanes: int, op, term, init: float = 0.0):
    """``op`` folded over ``term(at)`` for the ``n // lanes`` whole vectors ``at`` (``n`` may be a runtime value),
    starting from ``init``: per lane in a loop, then across lanes. ``term`` may also emit stores, which land inside
    the loop."""
    acc = T.alloc_buffer((lanes,), F32, scope="global")
    T.buffer_store(acc, _bcast(_f(init), lanes), [_vec(0, lanes)])
    with T.serial(0, n // lanes) as c:
        T.buffer_store(acc, op(acc[_vec(0, lanes)], term(_vec(c * lanes, lanes))), [_vec(0, lanes)])
    return _fold(acc[_vec(0, lanes)], lanes, op)


def rms_norm_func(name: str, n: int, widest: int, residual: bool):
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    lanes = _lanes(n, widest)
    with prim_func(name) as ib:
        X = arg("x", (1, n))
        D = arg("delta", (1, n)) if residual else None
        W = arg("w", (n,))
        eps = T.arg("eps", T.float32())
        OUT = arg("out", (1, n))
        scale = T.alloc_buffer((1,), F32, scope="global")

        def square(at):
            if residual:
                T.buffer_store(X, X[0, at] + D[0, at], [0, at])
            return X[0, at] * X[0, at]

        total = _lane_fold(T, n, lanes, lambda a, b: a + b, square)
        T.buffer_store(scale, _f(1.0) / tirx.sqrt(total / _f(float(n)) + eps), [0])
        with T.serial(0, n // lanes) as c:
            at = _vec(c * lanes, lanes)
            T.buffer_store(OUT, X[0, at] * _bcast(scale[0], lanes) * W[at], [0, at])
    return ib.get()


def quantize_func(name: str, n: int, widest: int):
    """Per-token absmax int8 fake-quantization in place: ``x·s`` rounded half-to-even, clamped, divided back."""
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    lanes = _lanes(n, widest)
    with prim_func(name) as ib:
        X = arg("x", (1, n))
        scale = T.alloc_buffer((1,), F32, scope="global")
        amax = _lane_fold(T, n, lanes, tirx.max, lambda at: tirx.abs(X[0, at]))
        T.buffer_store(scale, _f(127.0) / tirx.max(amax, _f(1e-5)), [0])
        with T.serial(0, n // lanes) as c:
            at = _vec(c * lanes, lanes)
            s = _bcast(scale[0], lanes)
            q = tirx.min(tirx.max(tirx.nearbyint(X[0, at] * s), _bcast(_f(-128.0), lanes)),
                         _bcast(_f(127.0), lanes))
            T.buffer_store(X, q / s, [0, at])
    return ib.get()


def attend_func(spec: GlueSpec, widest: int, sum_vectors: int):
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    h, kv, hd, kvd, blk = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.kv_dtype, KV_BLOCK
    group, half = h // kv, hd // 2
    lr = _lanes(half, widest)  # vectors over the rotation halves
    spans = _spans(hd, widest)  # and over a whole head (head_dim 100: six of 16 lanes and one of 4)

    def widen(x, lanes):  # a cache load as float32 (vcvtph2ps, fcvtl)
        return x if kvd == F32 else tirx.Cast(F32 if lanes == 1 else f"float32x{lanes}", x)

    def narrow(x, lanes):  # a float32 value as the cache stores it, rounded to nearest even (as torch's .half())
        return x if kvd == F32 else tirx.Cast(kvd if lanes == 1 else f"{kvd}x{lanes}", x)

    with prim_func("attend") as ib:
        ctx, nb = T.int32(), T.int32()
        QKV = arg("qkv", (1, (h + 2 * kv) * hd))
        COS = arg("cos", (ctx, 1, hd))
        SIN = arg("sin", (ctx, 1, hd))
        CK = arg("cache_k", (kv, nb, hd, blk), kvd)
        CV = arg("cache_v", (kv, nb * blk, hd), kvd)
        SC = arg("scores", (h, nb * blk))
        pos = T.arg("pos", T.int32())
        OUT = arg("out", (1, h * hd))
        # the rotated, scaled queries live in ``out`` until the values accumulate there: scratch buffers accessed
        # in more than one vector width segfault TVM 0.27's storage rewrite (argument buffers are fine)
        q = OUT
        keys_flat = T.decl_buffer((kv * nb * hd * blk,), kvd, data=CK.data)  # the new key's lanes are blk apart
        # heads sharing a pass over the keys, and over the values: a cached key or value is widened once per pass,
        # so as many as their sums fit the registers, and no more (docs/decisions.md, "Attention")
        hq = _heads_per_pass(group, max(blk // widest, 1), sum_vectors, blk)
        hv = _heads_per_pass(group, len(spans), sum_vectors)  # (a head's value sums: buffers of their own)

        def rotated(head, c):
            """The two rotated halves of vector ``c`` of ``head`` (q heads first, then k heads)."""
            x1, x2 = QKV[0, _vec(head * hd + c * lr, lr)], QKV[0, _vec(head * hd + half + c * lr, lr)]
            c1, s1 = COS[pos, 0, _vec(c * lr, lr)], SIN[pos, 0, _vec(c * lr, lr)]
            c2, s2 = COS[pos, 0, _vec(half + c * lr, lr)], SIN[pos, 0, _vec(half + c * lr, lr)]
            return x1 * c1 + (_bcast(_f(0.0), lr) - x2) * s1, x2 * c2 + x1 * s2

        with T.Assert(tirx.all(0 <= pos, pos < ctx, pos < nb * blk), "attend: position outside the KV cache",
                      "ValueError"):
            scale = _bcast(_f(hd ** -0.5), lr)
            with T.serial(0, h) as head:
                with T.serial(0, half // lr) as c:
                    r1, r2 = rotated(head, c)
                    T.buffer_store(q, r1 * scale, [0, _vec(head * hd + c * lr, lr)])
                    T.buffer_store(q, r2 * scale, [0, _vec(head * hd + half + c * lr, lr)])
            with T.serial(0, kv) as kh:
                key = (kh * nb + pos // blk) * hd * blk + pos % blk  # of dimension 0 of the new key
                with T.serial(0, half // lr) as c:
                    for r, d0 in zip(rotated(h + kh, c), (c * lr, half + c * lr)):
                        T.buffer_store(keys_flat, narrow(r, lr),
                                       [tirx.Ramp(key + d0 * blk, blk, lr) if lr > 1 else key + d0 * blk])
                for at, n in spans:
                    T.buffer_store(CV, narrow(QKV[0, _vec((h + kv + kh) * hd + at, n)], n), [kh, pos, _vec(at, n)])
            def phases(loop):
                # three phases over passes / heads (``loop``: in parallel or not), each task with its own scratch (a
                # single parallel loop doing all three ran at half the speed); a head's dimensions go round ``sets``
                # partial sums, as many as the registers hold: independent FMA chains hide the FMA latency
                # (docs/decisions.md, "Attention in three phases")
                per_set = hq * max(blk // widest, 1)  # vectors of one set of the pass's partial scores
                sets = next(n for n in (8, 4, 2, 1) if hd % n == 0 and (n == 1 or n * per_set <= sum_vectors))
                with loop(0, kv * (group // hq)) as kp:  # scores, a block of positions at a time, a key read once
                    kh = kp // (group // hq)               # per pass (for all the heads sharing it, in most models)
                    # a block's partial scores, a buffer a set (a buffer of all would outgrow the stack)
                    accs = [T.alloc_buffer((hq * blk,), F32, scope="global") for _ in range(sets)]
                    with T.serial(0, pos // blk + 1) as b:
                        for acc in accs:
                            for g in range(hq):
                                T.buffer_store(acc, _bcast(_f(0.0), blk), [_vec(g * blk, blk)])
                        with T.serial(0, hd // sets) as dd:
                            for j, acc in enumerate(accs):
                                d = dd * sets + j
                                k_d = widen(CK[kh, b, d, _vec(0, blk)], blk)
                                for g in range(hq):
                                    qd = _bcast(q[0, (kp * hq + g) * hd + d], blk)
                                    a = _vec(g * blk, blk)
                                    T.buffer_store(acc, acc[a] + qd * k_d, [a])
                        for g in range(hq):  # the block's positions past ``pos`` get scores nobody reads
                            total = accs[0][_vec(g * blk, blk)]
                            for acc in accs[1:]:
                                total = total + acc[_vec(g * blk, blk)]
                            T.buffer_store(SC, total, [kp * hq + g, _vec(b * blk, blk)])
                sl = widest  # softmax: whole vectors of the positions, then the rest one by one
                with loop(0, h) as head:
                    stat = T.alloc_buffer((2,), F32, scope="global")  # running max, then the sum of exponentials
                    n_t = pos + 1
                    whole = n_t // sl * sl

                    def exponentiated(at):  # e^(s − max) stored in place, and read back for the sum
                        T.buffer_store(SC, _exp(SC[head, at] - _bcast(stat[0], sl), sl), [head, at])
                        return SC[head, at]

                    T.buffer_store(stat, _lane_fold(T, n_t, sl, tirx.max, lambda at: SC[head, at], -3.0e38), [0])
                    with T.serial(whole, n_t) as t:
                        T.buffer_store(stat, tirx.max(stat[0], SC[head, t]), [0])
                    T.buffer_store(stat, _lane_fold(T, n_t, sl, lambda a, b: a + b, exponentiated), [1])
                    with T.serial(whole, n_t) as t:
                        T.buffer_store(SC, _exp(SC[head, t] - stat[0], 1), [head, t])
                        T.buffer_store(stat, stat[1] + SC[head, t], [1])
                    with T.serial(0, n_t // sl) as c:
                        at = _vec(c * sl, sl)
                        T.buffer_store(SC, SC[head, at] / _bcast(stat[1], sl), [head, at])
                    with T.serial(whole, n_t) as t:
                        T.buffer_store(SC, SC[head, t] / stat[1], [head, t])
                # values: a cached value is read once per pass, summed in scratch vectors for the pass's heads (stores
                # to ``out`` inside the loop would stay there: LLVM cannot tell ``out`` from the caches)
                slots = {at: (n, [m for _, m in spans[:i]].count(n)) for i, (at, n) in enumerate(spans)}  # width, index
                widths = {n: [m for _, m in spans].count(n) for _, n in spans}  # vectors of each width in a head
                with loop(0, kv * (group // hv)) as vp:
                    kh = vp // (group // hv)
                    # a head's sums of each width in a buffer of their own, on the stack (``STACK_BYTES``)
                    sums = {(g, n): T.alloc_buffer((count * n,), F32, scope="global")
                            for g in range(hv) for n, count in widths.items()}

                    def summed(g, at):
                        n, j = slots[at]
                        return sums[g, n], _vec(j * n, n)

                    for g in range(hv):
                        for at, n in spans:
                            buf, i = summed(g, at)
                            T.buffer_store(buf, _bcast(_f(0.0), n), [i])
                    with T.serial(0, pos + 1) as t:
                        for at, n in spans:
                            v = widen(CV[kh, t, _vec(at, n)], n)
                            for g in range(hv):
                                buf, i = summed(g, at)
                                T.buffer_store(buf, buf[i] + _bcast(SC[vp * hv + g, t], n) * v, [i])
                    for g in range(hv):
                        for at, n in spans:
                            buf, i = summed(g, at)
                            T.buffer_store(OUT, buf[i], [0, _vec((vp * hv + g) * hd + at, n)])

            # a parallel launch costs more than it saves over a short context: the phases run serially until the
            # scores cover PARALLEL_ATTENTION_WORK (docs/decisions.md, "Attention runs serially")
            with T.If((pos + 1) * (h * hd) >= PARALLEL_ATTENTION_WORK):
                with T.Then():
                    phases(T.parallel)
                with T.Else():
                    phases(T.serial)
    return ib.get()


def gated_act_func(spec: GlueSpec, widest: int):
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    f = spec.ffn_dim
    lanes = _lanes(f, widest)
    with prim_func("gated_act") as ib:
        GU = arg("gate_up", (1, 2 * f))
        OUT = arg("out", (1, f))
        with T.serial(0, f // lanes) as c:
            g, u = GU[0, _vec(c * lanes, lanes)], GU[0, _vec(f + c * lanes, lanes)]
            if spec.act == "silu":
                a = g / (_bcast(_f(1.0), lanes) + _exp(_bcast(_f(0.0), lanes) - g, lanes))
            else:  # relu2
                r = tirx.max(g, _bcast(_f(0.0), lanes))
                a = r * r
            T.buffer_store(OUT, a * u, [0, _vec(c * lanes, lanes)])
    return ib.get()


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
                w = (tirx.Cast(F32, q) - _f(float(offset))) * tirx.Cast(F32, S[at])
                if Z is not None:
                    w = w - tirx.Cast(F32, Z[at])
                T.buffer_store(OUT, w, [0, i])
    return ib.get()


def module(spec: GlueSpec, isa):
    """The IRModule of ``spec``'s glue functions."""
    import tvm

    widest = max(isa.vector_bytes // 4, 4)
    q_dim = spec.n_heads * spec.head_dim
    funcs = {"norm_in": rms_norm_func("norm_in", spec.dim, widest, True),
             "norm_final": rms_norm_func("norm_final", spec.dim, widest, True),
             "attend": attend_func(spec, widest, isa.sum_vectors), "gated_act": gated_act_func(spec, widest)}
    if spec.sub_norms:
        funcs["norm_attn"] = rms_norm_func("norm_attn", q_dim, widest, False)
        funcs["norm_hidden"] = rms_norm_func("norm_hidden", spec.ffn_dim, widest, False)
    if spec.act_quant:
        for name, n in (("dim", spec.dim), ("q", q_dim), ("ffn", spec.ffn_dim)):
            funcs[f"quantize_{name}"] = quantize_func(f"quantize_{name}", n, widest)
    if spec.embed_bits:
        funcs["embed"] = embed_func(spec)
    return tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
