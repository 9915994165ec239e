"""Generate the LUT kernels of one ``KernelSpec`` as TIR, composing an ISA's primitives.

Two functions per spec (layouts: ``tmac.packing``):

- ``build_tables(X[N, K], LUT[N', K/4, 16], LS[N', K/LG], XS[N', K/WG])``: the int8 tables, their scales and
  the activation sums, in exactly the float operations of ``tmac.reference``;
- ``lut_gemm(W, S[, Z], LUT, LS, XS, Y[N, M])``: parallel over row blocks; per activation-row tile, per lut
  group, the unrolled inner loop loads each weight vector once and looks it up in the tables of every row of
  the tile (``n_tile`` rows; the GEMV variant ``lut_gemv`` has a tile of 1), then a float epilogue applies
  table scale × weight scale and the ``(½s + z)·Σx`` term.

Kernels are built with TVM's IR builder so that Python decides the shape of the code (chunks, vectors,
tiles are unrolled here); nothing is left for a schedule.
"""

from __future__ import annotations

from tmac.packing import KernelSpec

from .tir import arg, prim_func


def build_tables_func(spec: KernelSpec):
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    k, lg, wg = spec.k, spec.lut_group, spec.group_size
    f32 = "float32"
    with prim_func("build_tables") as ib:
        n, np_ = T.int32(), T.int32()
        X = arg("x", (n, k))
        LUT = arg("lut", (np_, k // 4, 16), "int8")
        LS = arg("ls", (np_, k // lg))
        XS = arg("xs", (np_, k // wg))
        # scratch buffers are "global" scope: TVM puts small global-scope buffers on the stack (registers, once
        # LLVM promotes them), but services "local" ones with a workspace allocation per use
        tab = T.alloc_buffer((lg * 4,), f32, scope="global")  # the lg/4 float tables of one lut group
        amax = T.alloc_buffer((1,), f32, scope="global")
        lanes = T.alloc_buffer((16,), f32, scope="global")
        # the Python wrappers check this too; a raw call must still not write past the tables
        with T.Assert(n <= np_, "build_tables: the table buffers have fewer rows than the activations",
                      "ValueError"):
            with T.serial(0, n) as row:
                with T.serial(0, k // lg) as g:
                    with T.serial(0, lg // 4) as t:
                        xs = [X[row, g * lg + t * 4 + j] for j in range(4)]
                        with T.vectorized(0, 16) as p:
                            signed = [tirx.Select((p >> j) & 1 == 1, xs[j], -xs[j]) for j in range(4)]
                            T.buffer_store(tab, tirx.FloatImm(f32, 0.5) * ((signed[0] + signed[1])
                                                                          + (signed[2] + signed[3])), [t * 16 + p])
                    # the largest |entry| of a table is its all-signs-agree entry (rounded addition is
                    # monotonic, so this holds in fp32 too): one candidate per table, not 16
                    T.buffer_store(amax, tirx.FloatImm(f32, 0.0), [0])
                    with T.serial(0, lg // 4) as t:
                        xa = [tirx.abs(X[row, g * lg + t * 4 + j]) for j in range(4)]
                        T.buffer_store(amax, tirx.max(amax[0], tirx.FloatImm(f32, 0.5) * ((xa[0] + xa[1])
                                                                                         + (xa[2] + xa[3]))), [0])
                    inv = tirx.Select(amax[0] > tirx.FloatImm(f32, 0.0),
                                      tirx.FloatImm(f32, 127.0) / amax[0], tirx.FloatImm(f32, 0.0))
                    with T.vectorized(0, lg * 4) as i:
                        T.buffer_store(LUT, tirx.Cast("int8", tirx.nearbyint(tab[i] * inv)),
                                       [row, g * (lg // 4) + i // 16, i % 16])
                    T.buffer_store(LS, amax[0] / tirx.FloatImm(f32, 127.0), [row, g])
                with T.serial(0, k // wg) as g:  # activation sums: 16 running lanes, then their total
                    with T.vectorized(0, 16) as p:
                        T.buffer_store(lanes, X[row, g * wg + p], [p])
                    with T.serial(1, wg // 16) as i:
                        with T.vectorized(0, 16) as p:
                            T.buffer_store(lanes, lanes[p] + X[row, g * wg + i * 16 + p], [p])
                    T.buffer_store(XS, tirx.FloatImm(f32, 0.0), [row, g])
                    with T.serial(0, 16) as p:
                        T.buffer_store(XS, XS[row, g] + lanes[p], [row, g])
    return ib.get()


def lut_gemm_func(spec: KernelSpec, isa, n_tile: int, name: str):
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    k, lg, wg, bm, vl = spec.k, spec.lut_group, spec.group_size, spec.block_rows, isa.vector_bytes
    bits, u = spec.bits, spec.unroll
    f32 = "float32"
    pairs_per_group = lg // 8
    lut_groups_per_wg = wg // lg
    # (first plane, planes, vectors in the block, byte offset of the chunk, rows per vector)
    chunks = [(o, p, bm * p // vl, bm * o, vl // p) for o, p in spec.chunks]

    def vec(start, lanes):
        return tirx.Ramp(start, 1, lanes)

    def param(buf, *index):  # float16 parameters widen in registers (vcvtph2ps, fcvtl)
        return buf[index] if buf.dtype == f32 else tirx.Cast(f32, buf[index])

    with prim_func(name) as ib:
        mb, np_, n, m = T.int32(), T.int32(), T.int32(), T.int32()
        W = arg("w", (mb, k // 8, bm * bits), "uint8")
        S = arg("s", (mb, k // wg, bm), spec.scale_dtype)
        Z = arg("z", (mb, k // wg, bm), spec.zero_dtype) if spec.has_zeros else None
        LUT = arg("lut", (np_, k // 4, 16), "int8")
        LS = arg("ls", (np_, k // lg))
        XS = arg("xs", (np_, k // wg))
        Y = arg("y", (n, m))
        with T.Assert(tirx.all(n <= np_, np_ % n_tile == 0),
                      f"{name}: the tables must cover every output row in whole tiles of {n_tile}", "ValueError"):
            with T.parallel(0, mb) as blk:
                out = T.alloc_buffer((n_tile * bm,), f32, scope="global")
                racc = T.alloc_buffer((bm,), "int32", scope="global")
                accs = [T.alloc_buffer((nv * n_tile,), isa.acc_dtype(p), scope="global") for _, p, nv, _, _ in chunks]
                with T.serial(0, np_ // n_tile) as nt:
                    with T.vectorized(0, n_tile * bm) as i:
                        T.buffer_store(out, tirx.FloatImm(f32, 0.0), [i])
                    with T.serial(0, k // lg) as g:
                        for (_, p, nv, _, _), acc in zip(chunks, accs):
                            for a in range(nv * n_tile):
                                T.buffer_store(acc, tirx.Broadcast(tirx.IntImm(isa.acc_dtype(p).split("x")[0], 0),
                                                                   vl // p), [a])
                        with T.serial(0, pairs_per_group // u) as kpo:
                            with T.unroll(0, u) as kpi:
                                kp = g * pairs_per_group + kpo * u + kpi
                                tables = [(LUT[nt * n_tile + r, kp * 2, vec(0, 16)],
                                           LUT[nt * n_tile + r, kp * 2 + 1, vec(0, 16)]) for r in range(n_tile)]
                                for (_, p, nv, off, _), acc in zip(chunks, accs):
                                    for v in range(nv):
                                        w = W[blk, kp, vec(off + v * vl, vl)]
                                        lo = tirx.reinterpret(f"int8x{vl}", w & tirx.Broadcast(tirx.IntImm("uint8", 15), vl))
                                        hi = tirx.reinterpret(f"int8x{vl}", w >> tirx.Broadcast(tirx.IntImm("uint8", 4), vl))
                                        for r, (t_lo, t_hi) in enumerate(tables):
                                            a = v * n_tile + r
                                            looked = [isa.lookup(t_lo, lo), isa.lookup(t_hi, hi)]
                                            T.buffer_store(acc, isa.accumulate(acc[a], looked, p), [a])
                        wgi = g // lut_groups_per_wg
                        for r in range(n_tile):
                            row = nt * n_tile + r
                            for ci, ((o, p, nv, _, per_vec), acc) in enumerate(zip(chunks, accs)):
                                for v in range(nv):
                                    wide = tirx.Cast(f"int32x{per_vec}", acc[v * n_tile + r])
                                    if o:
                                        wide = wide << tirx.Broadcast(tirx.IntImm("int32", o), per_vec)
                                    if ci:
                                        wide = racc[vec(v * per_vec, per_vec)] + wide
                                    T.buffer_store(racc, wide, [vec(v * per_vec, per_vec)])
                            with T.vectorized(0, bm) as i:
                                T.buffer_store(out, out[r * bm + i] + tirx.Cast(f32, racc[i]) * (LS[row, g] * param(S, blk, wgi, i)),
                                               [r * bm + i])
                            with T.If(g % lut_groups_per_wg == lut_groups_per_wg - 1):
                                with T.Then():
                                    with T.vectorized(0, bm) as i:
                                        half_s = tirx.FloatImm(f32, 0.5) * param(S, blk, wgi, i)
                                        coef = half_s + param(Z, blk, wgi, i) if Z is not None else half_s
                                        T.buffer_store(out, out[r * bm + i] - coef * XS[row, wgi], [r * bm + i])
                    for r in range(n_tile):
                        row = nt * n_tile + r
                        with T.If(row < n):
                            with T.Then():
                                with T.serial(0, bm) as i:
                                    with T.If(blk * bm + i < m):
                                        with T.Then():
                                            T.buffer_store(Y, out[r * bm + i], [row, blk * bm + i])
    return ib.get()


def module(spec: KernelSpec, isa):
    """The IRModule of one spec: ``build_tables``, ``lut_gemv`` and ``lut_gemm``."""
    import tvm

    funcs = {"build_tables": build_tables_func(spec),
             "lut_gemv": lut_gemm_func(spec, isa, 1, "lut_gemv"),
             "lut_gemm": lut_gemm_func(spec, isa, spec.n_tile, "lut_gemm")}
    return tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
