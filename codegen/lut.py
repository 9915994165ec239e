"""Generate the LUT kernels of one ``KernelSpec`` as TIR, composing an ISA's primitives.

The functions of a spec (layouts: ``tmac.packing``):

- ``build_tables(X[N, K], LUT[N', K/4, 16], LS[N', K/LG], XS[N', K/WG])``: the int8 tables, their scales and
  the activation sums, in exactly the float operations of ``tmac.reference``;
- ``lut_gemm(W, S[, Z], LUT, LS, XS, Y[N, M])``: parallel over row blocks; per activation-row tile, per lut
  group, the unrolled inner loop loads each weight vector once and looks it up in the tables of every row of the
  tile (``n_tile`` rows), then a float epilogue applies table scale × weight scale and the ``(½s + z)·Σx`` term;
- ``lut_gemv(X[1, K], W, S[, Z], LUT, LS, XS, Y[1, M])``: one row, its tables built first in the same call (one
  call a projection: in a decode step whose weights stream from DRAM, each call into compiled code costs a few µs
  of Python state evicted from the caches), then the GEMM's loop with a tile of 1, a K chunk at a time.

Kernels are built with TVM's IR builder so that Python decides the shape of the code (chunks, vectors,
tiles are unrolled here); nothing is left for a schedule.
"""

from __future__ import annotations

from tmac.formats import code_offset
from tmac.spec import KernelSpec, packed_shapes
from tmac.reference import SIGNS, TRIPLE_COEFFS

from .tir import arg, prefetch, prim_func


def build_tables_func(spec: KernelSpec):
    from tvm.script.ir_builder import tirx as T

    with prim_func("build_tables") as ib:
        n, np_ = T.int32(), T.int32()
        lut_shape, ls_shape, xs_shape = spec.table_shapes(np_)
        X = arg("x", (n, spec.k))
        emit_tables(spec, X, arg("lut", lut_shape, "int8"), arg("ls", ls_shape), arg("xs", xs_shape), n, np_)
    return ib.get()


def emit_tables(spec: KernelSpec, X, LUT, LS, XS, n, np_) -> None:
    """The body of ``build_tables``, into the function being built."""
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    k, kp, lg, wg = spec.k, spec.k_padded, spec.lut_group, spec.group_size
    per = 3 if spec.triples else 4  # activations per table
    f32 = "float32"
    zero, half = tirx.FloatImm(f32, 0.0), tirx.FloatImm(f32, 0.5)
    # scratch buffers are "global" scope: TVM puts small global-scope buffers on the stack (registers, once
    # LLVM promotes them), but services "local" ones with a workspace allocation per use
    amax = T.alloc_buffer((1,), f32, scope="global")
    tv = min(16, lg // per)  # tables whose scale candidates are taken at once
    amaxv = T.alloc_buffer((tv,), f32, scope="global")
    lanes = T.alloc_buffer((16,), f32, scope="global")

    def constant(values):  # a float32 vector of these lanes (LLVM folds the shuffle of broadcasts)
        distinct = sorted(set(values))
        sources = [tirx.Broadcast(tirx.FloatImm(f32, v), len(values)) for v in distinct]
        return tirx.Shuffle(sources, [distinct.index(v) * len(values) + i for i, v in enumerate(values)])

    # coefficient vectors of the reference: entry p of a table is Σ_j coefs[j][p]·x_j (exact products)
    coefs = [constant([float(c) for c in column]) for column in (TRIPLE_COEFFS if spec.triples else SIGNS).T]

    def entries(xs):  # the 16 entries of the table of activations xs, in the reference's fp32 order
        t = [c * tirx.Broadcast(x, 16) for c, x in zip(coefs, xs)]
        return (t[0] + t[1]) + t[2] if spec.triples else \
            tirx.Broadcast(half, 16) * ((t[0] + t[1]) + (t[2] + t[3]))

    def largest(xa, lanes=1):  # |entry| of the all-signs-agree entry, the largest of a table (of `lanes` tables)
        h = half if lanes == 1 else tirx.Broadcast(half, lanes)
        return (xa[0] + xa[1]) + xa[2] if spec.triples else h * ((xa[0] + xa[1]) + (xa[2] + xa[3]))

    def lut_group(row, g, padded: bool):
        def x_at(i):  # past K, a zero activation; the load itself stays in bounds
            return tirx.if_then_else(i < k, X[row, i], zero) if padded else X[row, i]

        # the scale first, from one candidate per table, not 16: rounded addition is monotonic, so the
        # all-signs-agree entry is the largest in fp32 too; then each table computed and rounded in registers
        # (a float copy of the lut group's tables would outgrow TVM's stack scratch)
        T.buffer_store(amax, zero, [0])
        if padded:
            with T.serial(0, lg // per) as t:
                xa = [tirx.abs(x_at(g * lg + t * per + j)) for j in range(per)]
                T.buffer_store(amax, tirx.max(amax[0], largest(xa)), [0])
        else:  # the candidates of `tv` tables at a time: one load, de-interleaved by shuffles
            at = tirx.Ramp(0, 1, tv)
            T.buffer_store(amaxv, tirx.Broadcast(zero, tv), [at])
            with T.serial(0, lg // per // tv) as t:
                run = X[row, tirx.Ramp(g * lg + t * tv * per, 1, tv * per)]
                xa = [tirx.abs(tirx.Shuffle([run], [j + per * i for i in range(tv)])) for j in range(per)]
                T.buffer_store(amaxv, tirx.max(amaxv[at], largest(xa, tv)), [at])
            with T.serial(0, tv) as i:
                T.buffer_store(amax, tirx.max(amax[0], amaxv[i]), [0])
        inv = tirx.Select(amax[0] > zero, tirx.FloatImm(f32, 127.0) / amax[0], zero)
        with T.serial(0, lg // per) as t:
            xs = [x_at(g * lg + t * per + j) for j in range(per)]
            T.buffer_store(LUT, tirx.Cast("int8x16", tirx.nearbyint(entries(xs) * tirx.Broadcast(inv, 16))),
                           [row, g * (lg // per) + t, tirx.Ramp(0, 1, 16)])
        T.buffer_store(LS, amax[0] / tirx.FloatImm(f32, 127.0), [row, g])

    # the Python wrappers check this too; a raw call must still not write past the tables
    with T.Assert(n <= np_, "build_tables: the table buffers have fewer rows than the activations",
                  "ValueError"):
        with T.serial(0, n) as row:
            with T.serial(0, k // lg) as g:
                lut_group(row, g, padded=False)
            if kp != k:  # triples pad K with zero activations, in the last lut group only
                lut_group(row, k // lg, padded=True)
            with T.serial(0, k // wg) as g:  # activation sums: 16 running lanes, then their total
                with T.vectorized(0, 16) as p:
                    T.buffer_store(lanes, X[row, g * wg + p], [p])
                with T.serial(1, wg // 16) as i:
                    with T.vectorized(0, 16) as p:
                        T.buffer_store(lanes, lanes[p] + X[row, g * wg + i * 16 + p], [p])
                T.buffer_store(XS, tirx.FloatImm(f32, 0.0), [row, g])
                with T.serial(0, 16) as p:
                    T.buffer_store(XS, XS[row, g] + lanes[p], [row, g])


def lut_gemm_func(spec: KernelSpec, isa, n_tile: int, name: str, tables: bool = False):
    """``lut_gemm``, or with ``tables`` (``lut_gemv``) taking the activations ``x`` first and building the tables
    itself, as ``build_tables`` would."""
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    k, lg, wg, bm, vl = spec.k, spec.lut_group, spec.group_size, spec.block_rows, isa.vector_bytes
    u, steps = spec.unroll, spec.steps_per_lut_group
    # the GEMV streams its weights from DRAM once: reading them a little ahead (``Isa.prefetch_bytes``) keeps the
    # stream going while the lookups compute; the GEMM reads a block from cache once per activation-row tile
    ahead = isa.prefetch_bytes if n_tile == 1 else 0
    f32 = "float32"
    lut_groups_per_wg = wg // lg
    # a tile's accumulators (vectors × activation rows) must stay in registers: with more than
    # ``isa.gemm_accumulators`` the block's rows are done in parts, each with its own float sums (a block's would
    # outgrow TVM's stack scratch; docs/decisions.md, "GEMM parts")
    parts = 1
    while sum(bm * p // vl for _, p in spec.chunks) * n_tile > isa.gemm_accumulators * parts \
            and bm // (2 * parts) % vl == 0:
        parts *= 2
    sb = bm // parts  # rows of a part
    # (first plane, planes, vectors in a part, byte offset of the chunk, rows per vector)
    chunks = [(o, p, sb * p // vl, bm * o, vl // p) for o, p in spec.chunks]

    def vec(start, lanes):
        return tirx.Ramp(start, 1, lanes)

    def u8(value):
        return tirx.Broadcast(tirx.IntImm("uint8", value), vl)

    # quads (tmac.packing): in a quad chunk of P planes, byte p of a row's four holds plane p mod P of table p div P
    # of the low nibbles' window of four tables and of the high nibbles'; with P = 1 those are the chunk's tables 0-3
    # and 4-7, with P = 2 both are its four tables, the high nibbles indexing the last two
    ramp = tirx.Ramp(tirx.IntImm("int32", 0), tirx.IntImm("int32", 1), vl)

    def positions(planes):  # the table within the window each lane's low and high nibble index
        return [tirx.Cast(f"uint8x{vl}", ((ramp & tirx.Broadcast(tirx.IntImm("int32", 3), vl))
                                          // tirx.Broadcast(tirx.IntImm("int32", planes), vl) + first) << 4)
                for first in (0, 2 if planes == 2 else 0)]

    def nibbles(w, planes):  # the two table indices in each byte
        halves = [w & u8(15), w >> u8(4)]
        if not spec.quads:
            return [tirx.reinterpret(f"int8x{vl}", h) for h in halves]
        return [tirx.reinterpret(f"int8x{vl}", h | at) for h, at in zip(halves, positions(planes))]

    # per step: (first table of the low nibbles' lookups, of the high nibbles', first weight byte of the indices,
    # planes P and first plane of a quad chunk: bytes weighted 2^(first + p mod P))
    def pairs(step):
        if spec.quads:
            t = spec.step_tables * step
            return [(t + t0, t + t0 + (4 if planes == 1 else 0), 4 * bm * c, planes, first)
                    for c, (first, planes, t0) in enumerate(spec.quad_chunks)]
        if spec.triples:
            return [(8 * step + 2 * j, 8 * step + 2 * j + 1, j * bm, None, 0) for j in range(4)]
        return [(2 * step, 2 * step + 1, 0, None, 0)]

    def mask_start(j, v, h):  # first byte of the negation mask of pair j's low (h = 0) or high nibbles, vector v
        return 4 * bm + (v * vl // 4 + h * vl // 8 if spec.quads else v * vl + (2 * j + h) * vl // 8)

    def negated_where(looked, mask):  # −looked in the lanes whose flag is set (masked vpsubb on AVX-512)
        return tirx.Select(mask, tirx.Broadcast(tirx.IntImm("int8", 0), vl) - looked, looked)

    sg = spec.super_groups

    # K-quants (super scales): −(½s + z)·Σx = (offset − ½)·d·a·Σx − m·b·Σx, so a super group's terms are summed
    # with the multipliers a, b only, and d, m applied once at its end (per-group d·a and m·b − offset·d·a would
    # cost the epilogue more than the smaller parameters save); without zeros the term is −½·d·a·Σx
    sum_coef = tirx.FloatImm(f32, (float(code_offset(spec.bits)) if spec.has_zeros else 0.0) - 0.5)

    with prim_func(name) as ib:
        mb, np_, n, m = T.int32(), T.int32(), T.int32(), T.int32()
        X = arg("x", (n, k)) if tables else None
        w_shape, s_shape = packed_shapes(spec, 1)
        W = arg("w", (mb, *w_shape[1:]), "uint8")
        s_dtype, z_dtype = spec.param_dtypes
        S = arg("s", (mb, *s_shape[1:]), s_dtype)
        Z = arg("z", (mb, *s_shape[1:]), z_dtype) if spec.has_zeros else None
        lut_shape, ls_shape, xs_shape = spec.table_shapes(np_)
        LUT = arg("lut", lut_shape, "int8")
        LS = arg("ls", ls_shape)
        XS = arg("xs", xs_shape)
        Y = arg("y", (n, m))
        if tables:
            emit_tables(spec, X, LUT, LS, XS, n, np_)
        tw, lookup = (64, isa.lookup64) if spec.quads else (16, isa.lookup)  # quads look into 4 adjacent tables
        tables_flat = T.decl_buffer((np_, lut_shape[1] * 16), "int8", data=LUT.data, align=1)
        steps_total, row_bytes = w_shape[1], w_shape[2]
        WF = T.decl_buffer((mb * steps_total * row_bytes,), "uint8", data=W.data, align=1)
        SF, ZF = (None if b is None else T.decl_buffer((mb * s_shape[1] * s_shape[2],), b.dtype, data=b.data, align=1)
                  for b in (S, Z))
        if sg:  # the super scales, after each super group's multipliers (float16 ones widen in registers)
            fb = spec.super_bytes
            SS, ZS = (None if b is None else T.decl_buffer((mb * s_shape[1] * s_shape[2] // fb,), spec.scale_dtype,
                                                          data=b.data, align=1) for b in (S, Z))

        # K chunks (tmac.packing): chunk c of W, S and Z holds every block's rows (steps, weight or super groups) of
        # its lut groups, so row r of block blk in a chunk of rows [r0, r0 + rc) is flat row mb·r0 + blk·rc + (r − r0)
        def chunk_row(blk, r, r0, rc):
            return mb * r0 + blk * rc + (r - r0)

        # float16 parameters widen in registers (vcvtph2ps, fcvtl); so do multipliers
        def param(buf, blk, g, row, g0, gc):
            if sg:  # [super group][multipliers of its SG groups, then F·BM bytes of d or m]
                at = chunk_row(blk, g // sg, g0 // sg, gc // sg) * (sg + fb) * bm + g % sg * bm + row
            elif s_shape[1] == 1:  # one scale a row: not chunked
                at = blk * bm + row
            else:
                at = chunk_row(blk, g, g0, gc) * bm + row
            return buf[at] if buf.dtype == f32 else tirx.Cast(f32, buf[at])

        def blocks(each_chunk, first):
            """Every row block over the K chunks ``each_chunk`` emits (``first``: they start the sum; otherwise the
            block's rows start from Y)."""
            with T.parallel(0, mb) as blk:
                out = T.alloc_buffer((n_tile * sb,), f32, scope="global")
                # K-quants: a super group's Σ a·(terms) and Σ b·Σx, per row of the tile
                sums = [T.alloc_buffer((n_tile * sb,), f32, scope="global")
                        for _ in range((2 if spec.has_zeros else 1) if sg else 0)]
                racc = T.alloc_buffer((sb,), "int32", scope="global")
                accs = [T.alloc_buffer((nv * n_tile,), isa.acc_dtype(p, steps), scope="global")
                        for _, p, nv, _, _ in chunks]
                with T.serial(0, np_ // n_tile) as nt:
                    with T.serial(0, parts) as part:  # the block's rows, a part at a time
                        first_row = part * sb  # first row of the part in the block
                        for r in range(n_tile):  # later chunks go on from Y: the float sums keep their order
                            row = nt * n_tile + r
                            with T.serial(0, sb) as i:
                                col = blk * bm + first_row + i
                                y = tirx.if_then_else(tirx.all(tirx.Not(first), row < n, col < m), Y[row, col],
                                                      tirx.FloatImm(f32, 0.0))
                                T.buffer_store(out, y, [r * sb + i])

                        def groups(g0, gc):  # lut groups [g0, g0 + gc) of one K chunk
                            def byte_at(step, start):  # flat index in W of the block's ``step`` (a global index)
                                return chunk_row(blk, step, g0 * steps, gc * steps) * row_bytes + start

                            def weights(step, start, lanes):
                                return WF[vec(byte_at(step, start), lanes)]

                            def lut_group(g):  # the weights of lut group g: integer sums, then the float epilogue
                                for (_, p, nv, _, _), acc in zip(chunks, accs):
                                    elem, lanes = isa.acc_dtype(p, steps).split("x")
                                    for a in range(nv * n_tile):
                                        T.buffer_store(acc, tirx.Broadcast(tirx.IntImm(elem, 0), int(lanes)), [a])
                                with T.serial(0, steps // u) as kpo:
                                    with T.unroll(0, u) as kpi:
                                        step = g * steps + kpo * u + kpi
                                        for j, (t_lo, t_hi, base, qp, first_plane) in enumerate(pairs(step)):
                                            tables = [tuple(tables_flat[nt * n_tile + r, vec(t * 16, tw)] for t in (t_lo, t_hi))
                                                      for r in range(n_tile)]
                                            for (_, p, nv, off, _), acc in zip(chunks, accs):
                                                for v in range(nv):
                                                    vb = part * nv + v  # the vector in the block
                                                    start = base + off + vb * vl
                                                    if ahead and (base + off + v * vl) % 64 == 0:  # a line's first
                                                        prefetch(WF, byte_at(step, start + ahead))
                                                    idx = nibbles(weights(step, start, vl), qp)
                                                    masks = [isa.lane_mask(weights(step, mask_start(j, vb, h), vl // 8))
                                                             for h in (0, 1)] if spec.triples else None
                                                    for r, t_pair in enumerate(tables):
                                                        looked = [lookup(t, i) for t, i in zip(t_pair, idx)]
                                                        if masks is not None:
                                                            looked = [negated_where(x, mk) for x, mk in zip(looked, masks)]
                                                        a = v * n_tile + r
                                                        total = isa.accumulate(acc[a], looked, p, qp or p, first_plane)
                                                        T.buffer_store(acc, total, [a])
                                wgi = 0 if spec.triples else g // lut_groups_per_wg
                                wg0, wgc = g0 // lut_groups_per_wg, gc // lut_groups_per_wg  # the chunk's weight groups
                                for r in range(n_tile):
                                    row = nt * n_tile + r
                                    for ci, ((o, p, nv, _, per_vec), acc) in enumerate(zip(chunks, accs)):
                                        rows = isa.acc_rows(p)  # lanes → rows of the block, where not in order
                                        for v in range(nv):
                                            lanes = acc[v * n_tile + r]
                                            if rows is not None:
                                                lanes = tirx.Shuffle([lanes], [rows.index(i) for i in range(per_vec)])
                                            wide = isa.widen(lanes, p)
                                            if o:
                                                wide = wide << tirx.Broadcast(tirx.IntImm("int32", o), per_vec)
                                            if ci:
                                                wide = racc[vec(v * per_vec, per_vec)] + wide
                                            T.buffer_store(racc, wide, [vec(v * per_vec, per_vec)])
                                    with T.vectorized(0, sb) as i:
                                        at = r * sb + i
                                        if sg:  # a lut group is a weight group (KernelSpec): a's terms in one
                                            term = tirx.Cast(f32, racc[i]) * LS[row, g] + sum_coef * XS[row, wgi]
                                            T.buffer_store(sums[0], sums[0][at] + term *
                                                           param(SF, blk, wgi, first_row + i, wg0, wgc), [at])
                                        else:
                                            T.buffer_store(out, out[at] + tirx.Cast(f32, racc[i]) *
                                                           (LS[row, g] * param(SF, blk, wgi, first_row + i, wg0, wgc)), [at])
                                    if spec.triples:  # ternary triples are symmetric: no Σx term
                                        continue
                                    if sg and Z is None:  # the Σx term rode with a's (sum_coef)
                                        continue
                                    with T.If(g % lut_groups_per_wg == lut_groups_per_wg - 1):
                                        with T.Then():
                                            with T.vectorized(0, sb) as i:
                                                at = r * sb + i
                                                if sg:
                                                    T.buffer_store(sums[1], sums[1][at] + param(
                                                        ZF, blk, wgi, first_row + i, wg0, wgc) * XS[row, wgi], [at])
                                                else:
                                                    half_s = tirx.FloatImm(f32, 0.5) * param(SF, blk, wgi, first_row + i,
                                                                                             wg0, wgc)
                                                    coef = half_s + param(ZF, blk, wgi, first_row + i, wg0, wgc) \
                                                        if Z is not None else half_s
                                                    T.buffer_store(out, out[at] - coef * XS[row, wgi], [at])
                            if sg:  # K-quants: a super group's lut groups (= weight groups), then its d and m
                                with T.serial(0, gc // sg) as jj:
                                    j = g0 // sg + jj
                                    with T.vectorized(0, n_tile * sb) as i:
                                        for buf in sums:
                                            T.buffer_store(buf, tirx.FloatImm(f32, 0.0), [i])
                                    # two lut groups a body: the super group's sums then stay in registers
                                    # (docs/decisions.md, "K-quants")
                                    with T.serial(0, sg // 2) as gio:
                                        with T.unroll(0, 2) as gii:
                                            lut_group(j * sg + gio * 2 + gii)
                                    for r in range(n_tile):
                                        with T.vectorized(0, sb) as i:
                                            at = r * sb + i
                                            base = (chunk_row(blk, j, g0 // sg, gc // sg) * (sg + fb) + sg) * bm // fb + \
                                                first_row + i
                                            total = tirx.Cast(f32, SS[base]) * sums[0][at]
                                            if Z is not None:
                                                total = total - tirx.Cast(f32, ZS[base]) * sums[1][at]
                                            T.buffer_store(out, out[at] + total, [at])
                            else:
                                with T.serial(0, gc) as gi:
                                    lut_group(g0 + gi)

                        each_chunk(groups)
                        for r in range(n_tile):
                            row = nt * n_tile + r
                            with T.If(row < n):
                                with T.Then():
                                    with T.serial(0, sb) as i:
                                        col = blk * bm + first_row + i
                                        with T.If(col < m):
                                            with T.Then():
                                                T.buffer_store(Y, out[r * sb + i], [row, col])

        with T.Assert(tirx.all(n <= np_, np_ % n_tile == 0),
                      f"{name}: the tables must cover every output row in whole tiles of {n_tile}", "ValueError"):
            groups_total, groups_per_chunk = spec.k_padded // lg, spec.k_chunk // lg
            full, tail = divmod(groups_total, groups_per_chunk)
            if n_tile == 1:
                # the GEMV streams each weight once: a chunk at a time over all blocks, in one parallel launch (TVM
                # splits a parallel loop inside a launch point statically: each thread takes the same blocks of
                # every chunk, so no chunk waits for another thread); the chunk sizes are constants (the shorter
                # last chunk its own code: a computed size was slower; docs/decisions.md, "K chunks")
                with T.attr(tirx.const(0, "int32"), "pragma_parallel_launch_point", tirx.const(1, "int32")):
                    with T.serial(0, full) as c:
                        blocks(lambda emit, c=c: emit(c * groups_per_chunk, groups_per_chunk), c == 0)
                    if tail:
                        blocks(lambda emit: emit(full * groups_per_chunk, tail), tirx.const(full == 0, "bool"))
            else:
                # the GEMM reads a block's weights once per row tile, from cache: every chunk of a block in turn,
                # one code for all (a second copy of the unrolled body for the last chunk was slower)
                def every_chunk(emit):
                    with T.serial(0, full + (tail > 0)) as c:
                        g0 = c * groups_per_chunk
                        emit(g0, tirx.min(groups_per_chunk, groups_total - g0))

                blocks(every_chunk, tirx.const(True, "bool"))
    return ib.get()


def module(spec: KernelSpec, isa):
    """The IRModule of one spec: ``build_tables``, ``lut_gemv`` and ``lut_gemm``."""
    import tvm

    funcs = {"build_tables": build_tables_func(spec),
             "lut_gemv": lut_gemm_func(spec, isa, 1, "lut_gemv", tables=True),
             "lut_gemm": lut_gemm_func(spec, isa, spec.n_tile, "lut_gemm")}
    return tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
