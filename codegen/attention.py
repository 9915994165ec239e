"""Generate ``attend``, the decode step's attention over the KV cache (what it does: ``tmac.base.glue``), as TIR: the new
position's biases, q/k norms, RoPE and cache update, then the scores, the softmax and the values in three phases,
serial over a short context and parallel over a long one; over the positions a sliding window sees, where it has
one."""

from __future__ import annotations

from tmac.base.glue import KV_BLOCK, PARALLEL_ATTENTION_WORK, ROWS, GlueSpec

from tmac.codegen.tir import arg, prim_func
from tmac.codegen.vectors import F32, bcast, exp, f32, lane_fold, lanes_of, rms_scale, spans_of, vec

# TVM keeps a scratch buffer smaller than this on the stack; a larger one comes from its workspace allocator, memory
# LLVM cannot tell from the arguments, so an accumulator kept there is stored back on every loop iteration
STACK_BYTES = 1024


def _heads_per_pass(group: int, vectors_per_head: int, sums: int, floats_per_buffer: int = 0) -> int:
    """The most heads of a kv head's group (a divisor of it) whose running sums, ``vectors_per_head`` vectors a
    head, fit ``sums`` registers (``Isa.sum_vectors``), and a buffer of ``floats_per_buffer`` floats a head the
    stack."""
    fits = [d for d in range(2, group + 1) if group % d == 0 and d * vectors_per_head <= sums
            and d * floats_per_buffer * 4 < STACK_BYTES]
    return max(fits, default=1)


class _Attend:
    """What the emitters of ``attend`` share: the spec's sizes, the function's buffers (``declare``) and how many
    heads share a pass over the keys and over the values."""

    def __init__(self, spec: GlueSpec, widest: int, sum_vectors: int, batched: bool = False):
        self.spec, self.batched = spec, batched
        self.row = 0  # the row of ``qkv`` and ``out`` being emitted (a loop variable of the batched variant)
        self.h, self.kv, self.hd, self.kvd, self.blk = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.kv_dtype, \
            KV_BLOCK
        self.widest, self.sum_vectors = widest, sum_vectors
        self.rot = spec.rotary_dim or self.hd
        self.group, self.half = self.h // self.kv, self.rot // 2
        self.scale = spec.attn_scale or self.hd ** -0.5
        self.lr = lanes_of(self.half, widest)  # vectors over the rotation halves
        self.spans = spans_of(self.hd, widest)  # and over a whole head (head_dim 100: six of 16 lanes and one of 4)
        # heads sharing a pass over the keys, and over the values: a cached key or value is widened once per pass,
        # so as many as their sums fit the registers, and no more (docs/decisions.md, "Attention")
        self.hq = _heads_per_pass(self.group, max(self.blk // widest, 1), sum_vectors, self.blk)
        self.hv = _heads_per_pass(self.group, len(self.spans), sum_vectors)  # (a head's value sums: own buffers)

    def widen(self, x, lanes):
        """A cache load as float32 (vcvtph2ps, fcvtl)."""
        from tvm import tirx

        return x if self.kvd == F32 else tirx.Cast(F32 if lanes == 1 else f"float32x{lanes}", x)

    def narrow(self, x, lanes):
        """A float32 value as the cache stores it, rounded to nearest even (as torch's ``.half()``)."""
        from tvm import tirx

        return x if self.kvd == F32 else tirx.Cast(self.kvd if lanes == 1 else f"{self.kvd}x{lanes}", x)

    def declare(self) -> None:
        from tvm.script.ir_builder import tirx as T

        h, kv, hd, kvd, blk = self.h, self.kv, self.hd, self.kvd, self.blk
        self.ctx, self.nb = ctx, nb = T.int32(), T.int32()
        rows = self.rows = T.int32() if self.batched else 1
        self.QKV = arg("qkv", (rows, (h + 2 * kv) * hd))
        self.BIAS = arg("bias", (1, (h + 2 * kv) * hd)) if self.spec.qkv_bias else None
        if self.spec.qk_norm:
            self.QN, self.KN = arg("q_norm", (hd,)), arg("k_norm", (hd,))
            self.eps = T.arg("eps", T.float32())
        self.COS = arg("cos", (ctx, 1, self.rot))
        self.SIN = arg("sin", (ctx, 1, self.rot))
        self.CK = arg("cache_k", (kv, nb, hd, blk), kvd)
        self.CV = arg("cache_v", (kv, nb * blk, hd), kvd)
        if self.batched:  # a scratch of scores per task: the rows' attention runs in ``tasks`` parallel tasks
            self.tasks = T.int32()
            self.SCR = arg("scores", (self.tasks, h, nb * blk))
        else:
            self.SC = arg("scores", (h, nb * blk))
        self.pos = self.start = T.arg("pos", T.int32())
        self.last = T.arg("last", T.int32()) if self.batched else None
        self.window = T.arg("window", T.int32()) if self.spec.window else None
        self.OUT = arg("out", (rows, h * hd))
        # the rotated, scaled queries live in ``out`` until the values accumulate there: scratch buffers accessed
        # in more than one vector width segfault TVM 0.27's storage rewrite (argument buffers are fine)
        self.q = self.OUT
        self.keys_flat = T.decl_buffer((kv * nb * hd * blk,), kvd, data=self.CK.data)  # a key's lanes are blk apart

    def first_seen(self):
        """The first position the new one attends to: the window's first, or 0."""
        from tvm import tirx

        if self.window is None:
            return 0
        return tirx.Select(self.window > 0, tirx.max(self.pos - self.window + 1, 0), 0)

    def emit_biases_and_norms(self) -> None:
        """q, k and v plus their biases; then each q and k head normalized (RMSNorm with its weights), in place."""
        from tvm.script.ir_builder import tirx as T

        h, kv, hd, widest = self.h, self.kv, self.hd, self.widest
        if self.BIAS is not None:
            n = (h + 2 * kv) * hd
            lanes = lanes_of(n, widest)
            with T.serial(0, n // lanes) as c:
                at = vec(c * lanes, lanes)
                T.buffer_store(self.QKV, self.QKV[self.row, at] + self.BIAS[0, at], [self.row, at])
        if not self.spec.qk_norm:
            return
        lanes = lanes_of(hd, widest)
        for first, count, weight in ((0, h, self.QN), (h, kv, self.KN)):
            with T.serial(first, first + count) as head:
                scale = rms_scale(T, hd, lanes, lambda at: self.QKV[self.row, head * hd + at] *
                                  self.QKV[self.row, head * hd + at],
                                  self.eps)
                with T.serial(0, hd // lanes) as c:
                    at = vec(c * lanes, lanes)
                    T.buffer_store(self.QKV, self.QKV[self.row, head * hd + at] * bcast(scale[0], lanes) * weight[at],
                                   [self.row, head * hd + at])

    def rotated(self, head, c):
        """The two rotated halves of vector ``c`` of ``head`` (q heads first, then k heads)."""
        hd, half, lr, pos = self.hd, self.half, self.lr, self.pos
        row = self.row
        x1, x2 = self.QKV[row, vec(head * hd + c * lr, lr)], self.QKV[row, vec(head * hd + half + c * lr, lr)]
        c1, s1 = self.COS[pos, 0, vec(c * lr, lr)], self.SIN[pos, 0, vec(c * lr, lr)]
        c2, s2 = self.COS[pos, 0, vec(half + c * lr, lr)], self.SIN[pos, 0, vec(half + c * lr, lr)]
        return x1 * c1 + (bcast(f32(0.0), lr) - x2) * s1, x2 * c2 + x1 * s2

    def emit_new_position(self, write=None) -> None:
        """The queries rotated and scaled into ``out``; the new key rotated and the new value into the caches (where
        ``write`` holds, when given)."""
        from tvm.script.ir_builder import tirx as T

        h, hd, half, lr = self.h, self.hd, self.half, self.lr
        scale = bcast(f32(self.scale), lr)
        with T.serial(0, h) as head:
            with T.serial(0, half // lr) as c:
                r1, r2 = self.rotated(head, c)
                T.buffer_store(self.q, r1 * scale, [self.row, vec(head * hd + c * lr, lr)])
                T.buffer_store(self.q, r2 * scale, [self.row, vec(head * hd + half + c * lr, lr)])
            with T.serial(self.rot, hd) as d:  # dimensions past the rotary ones: scaled only
                T.buffer_store(self.q, self.QKV[self.row, head * hd + d] * f32(self.scale), [self.row, head * hd + d])
        if write is None:
            self._emit_cache_write()
            return
        with T.If(write):
            with T.Then():
                self._emit_cache_write()

    def _emit_cache_write(self) -> None:
        """The new key, rotated, and the new value into the caches at ``pos``."""
        from tvm import tirx
        from tvm.script.ir_builder import tirx as T

        h, kv, hd, half, lr, blk, pos = self.h, self.kv, self.hd, self.half, self.lr, self.blk, self.pos
        with T.serial(0, kv) as kh:
            key = (kh * self.nb + pos // blk) * hd * blk + pos % blk  # of dimension 0 of the new key
            with T.serial(0, half // lr) as c:
                for r, d0 in zip(self.rotated(h + kh, c), (c * lr, half + c * lr)):
                    T.buffer_store(self.keys_flat, self.narrow(r, lr),
                                   [tirx.Ramp(key + d0 * blk, blk, lr) if lr > 1 else key + d0 * blk])
            with T.serial(self.rot, hd) as d:
                T.buffer_store(self.keys_flat, self.narrow(self.QKV[self.row, (h + kh) * hd + d], 1),
                               [key + d * blk])
            for at, n in self.spans:
                T.buffer_store(self.CV, self.narrow(self.QKV[self.row, vec((h + kv + kh) * hd + at, n)], n),
                               [kh, pos, vec(at, n)])

    def emit_scores(self, loop) -> None:
        """Query-key products, a block of positions at a time, a key read once per pass (for all the heads sharing
        it, in most models); a head's dimensions go round ``sets`` partial sums, as many as the registers hold:
        independent FMA chains hide the FMA latency."""
        from tvm.script.ir_builder import tirx as T

        hq, hd, blk, widest, q = self.hq, self.hd, self.blk, self.widest, self.q
        per_set = hq * max(blk // widest, 1)  # vectors of one set of the pass's partial scores
        sets = next(n for n in (8, 4, 2, 1) if hd % n == 0 and (n == 1 or n * per_set <= self.sum_vectors))
        with loop(0, self.kv * (self.group // hq)) as kp:
            kh = kp // (self.group // hq)
            # a block's partial scores, a buffer a set (a buffer of all would outgrow the stack)
            accs = [T.alloc_buffer((hq * blk,), F32, scope="global") for _ in range(sets)]
            with T.serial(self.first_seen() // blk, self.pos // blk + 1) as b:
                for acc in accs:
                    for g in range(hq):
                        T.buffer_store(acc, bcast(f32(0.0), blk), [vec(g * blk, blk)])
                with T.serial(0, hd // sets) as dd:
                    for j, acc in enumerate(accs):
                        d = dd * sets + j
                        k_d = self.widen(self.CK[kh, b, d, vec(0, blk)], blk)
                        for g in range(hq):
                            qd = bcast(q[self.row, (kp * hq + g) * hd + d], blk)
                            a = vec(g * blk, blk)
                            T.buffer_store(acc, acc[a] + qd * k_d, [a])
                for g in range(hq):  # the block's positions past ``pos`` get scores nobody reads
                    total = accs[0][vec(g * blk, blk)]
                    for acc in accs[1:]:
                        total = total + acc[vec(g * blk, blk)]
                    T.buffer_store(self.SC, self.capped(total, blk), [kp * hq + g, vec(b * blk, blk)])

    def capped(self, s, lanes: int):
        """Gemma 2's soft cap of scores ``s``: c·tanh(s/c) = c − 2c/(e^(2s/c) + 1), which saturates to ±c."""
        cap = self.spec.softcap
        if not cap:
            return s
        e = exp(s * bcast(f32(2.0 / cap), lanes), lanes)
        return bcast(f32(cap), lanes) - bcast(f32(2.0 * cap), lanes) / (e + bcast(f32(1.0), lanes))

    def emit_softmax(self, loop) -> None:
        """Each head's scores up to ``pos`` in place: whole vectors of the positions, then the rest one by one."""
        from tvm import tirx
        from tvm.script.ir_builder import tirx as T

        SC, sl = self.SC, self.widest
        first = self.first_seen()
        start = first // self.blk * self.blk  # the first scored block's (a multiple of the lanes)
        with loop(0, self.h) as head:
            stat = T.alloc_buffer((2,), F32, scope="global")  # running max, then the sum of exponentials
            n_t = self.pos + 1
            whole = n_t // sl * sl
            if self.window is not None:  # the block's positions before the window: e^(-3e38 − max) adds < 2e-38
                with T.serial(start, first) as t:
                    T.buffer_store(SC, f32(-3.0e38), [head, t])

            def exponentiated(at):  # e^(s − max) stored in place, and read back for the sum
                T.buffer_store(SC, exp(SC[head, at] - bcast(stat[0], sl), sl), [head, at])
                return SC[head, at]

            T.buffer_store(stat, lane_fold(T, n_t, sl, tirx.max, lambda at: SC[head, at], -3.0e38, start), [0])
            with T.serial(whole, n_t) as t:  # (start ≤ whole: both multiples of the lanes, start ≤ pos)
                T.buffer_store(stat, tirx.max(stat[0], SC[head, t]), [0])
            T.buffer_store(stat, lane_fold(T, n_t, sl, lambda a, b: a + b, exponentiated, 0.0, start), [1])
            with T.serial(whole, n_t) as t:
                T.buffer_store(SC, exp(SC[head, t] - stat[0], 1), [head, t])
                T.buffer_store(stat, stat[1] + SC[head, t], [1])
            with T.serial(start // sl, n_t // sl) as c:
                at = vec(c * sl, sl)
                T.buffer_store(SC, SC[head, at] / bcast(stat[1], sl), [head, at])
            with T.serial(whole, n_t) as t:
                T.buffer_store(SC, SC[head, t] / stat[1], [head, t])

    def emit_values(self, loop) -> None:
        """The probabilities times the values into ``out``: a cached value is read once per pass, summed in scratch
        vectors for the pass's heads (stores to ``out`` inside the loop would stay there: LLVM cannot tell ``out``
        from the caches)."""
        from tvm.script.ir_builder import tirx as T

        spans, hv, hd = self.spans, self.hv, self.hd
        slots = {at: (n, [m for _, m in spans[:i]].count(n)) for i, (at, n) in enumerate(spans)}  # width, index
        widths = {n: [m for _, m in spans].count(n) for _, n in spans}  # vectors of each width in a head
        with loop(0, self.kv * (self.group // hv)) as vp:
            kh = vp // (self.group // hv)
            # a head's sums of each width in a buffer of their own, on the stack (``STACK_BYTES``)
            sums = {(g, n): T.alloc_buffer((count * n,), F32, scope="global")
                    for g in range(hv) for n, count in widths.items()}

            def summed(g, at):
                n, j = slots[at]
                return sums[g, n], vec(j * n, n)

            for g in range(hv):
                for at, n in spans:
                    buf, i = summed(g, at)
                    T.buffer_store(buf, bcast(f32(0.0), n), [i])
            with T.serial(self.first_seen(), self.pos + 1) as t:
                for at, n in spans:
                    v = self.widen(self.CV[kh, t, vec(at, n)], n)
                    for g in range(hv):
                        buf, i = summed(g, at)
                        T.buffer_store(buf, buf[i] + bcast(self.SC[vp * hv + g, t], n) * v, [i])
            for g in range(hv):
                for at, n in spans:
                    buf, i = summed(g, at)
                    T.buffer_store(self.OUT, buf[i], [self.row, vec((vp * hv + g) * hd + at, n)])

    def emit(self) -> None:
        from tvm import tirx
        from tvm.script.ir_builder import tirx as T

        pos, blk = self.pos, self.blk
        with T.Assert(tirx.all(0 <= pos, pos < self.ctx, pos < self.nb * blk), "attend: position outside the KV cache",
                      "ValueError"):
            self.emit_biases_and_norms()
            self.emit_new_position()

            def phases(loop):
                # three phases over passes / heads (``loop``: in parallel or not), each task with its own scratch (a
                # single parallel loop doing all three ran at half the speed; docs/decisions.md, "Attention in three
                # phases")
                self.emit_scores(loop)
                self.emit_softmax(loop)
                self.emit_values(loop)

            # a parallel launch costs more than it saves over a short context: the phases run serially until the
            # scores cover PARALLEL_ATTENTION_WORK (docs/decisions.md, "Attention runs serially")
            with T.If((pos + 1) * (self.h * self.hd) >= PARALLEL_ATTENTION_WORK):
                with T.Then():
                    phases(T.parallel)
                with T.Else():
                    phases(T.serial)


    def emit_rows(self) -> None:
        """The batched variant: row r of ``qkv`` is position ``pos + min(r, last)`` of one sequence (rows past
        ``last`` repeat it). Every row's RoPE (and each new position's cache update) first, in parallel; then each
        row's attention over the positions up to its own (causal: all written by then), in parallel tasks of rows
        ``tasks`` apart (a row's work grows with its position), each task with its own scores (``scores[task]``)."""
        from tvm import tirx
        from tvm.script.ir_builder import tirx as T

        rows, start, last = self.rows, self.start, self.last
        with T.Assert(tirx.all(0 <= start, 0 <= last, last < rows, start + last < self.ctx,
                               start + last < self.nb * self.blk), "attend_rows: positions outside the KV cache",
                      "ValueError"):
            with T.parallel(0, rows) as r:
                self.row, self.pos = r, start + tirx.min(r, last)
                self.emit_biases_and_norms()
                self.emit_new_position(write=r <= last)  # (a repeated row's key and value are its original's)
            per = self.h * self.nb * self.blk
            with T.parallel(0, self.tasks) as task:  # rows task, task + tasks, …: a mix of short and long ones
                self.SC = T.decl_buffer((self.h, self.nb * self.blk), F32, data=self.SCR.data, elem_offset=task * per)
                with T.serial(0, (rows - task + self.tasks - 1) // self.tasks) as j:
                    self._emit_row_attention(task + j * self.tasks)

    def _emit_row_attention(self, r) -> None:
        from tvm import tirx
        from tvm.script.ir_builder import tirx as T

        self.row, self.pos = r, self.start + tirx.min(r, self.last)
        self.emit_scores(T.serial)
        self.emit_softmax(T.serial)
        self.emit_values(T.serial)


def attend_func(spec: GlueSpec, widest: int, sum_vectors: int, batched: bool = False):
    """``attend``: the new position's RoPE and cache update, then scores, softmax and values in three phases;
    ``batched``: ``attend_rows``, the same for consecutive positions of one sequence (``_Attend.emit_rows``)."""
    attend = _Attend(spec, widest, sum_vectors, batched)
    with prim_func("attend" + ROWS * batched) as ib:
        attend.declare()
        attend.emit_rows() if batched else attend.emit()
    return ib.get()
