"""``build_tables``: the int8 tables of a spec's activations, their scales and the activation sums, in exactly the
float operations of ``tmac.base.reference``; ``emit_tables`` also opens ``lut_gemv``, which builds its own."""

from __future__ import annotations

from tmac.quant.spec import PARALLEL_TABLE_ROWS, KernelSpec

from tmac.codegen.tir import arg, prim_func
from tmac.codegen.vectors import constant


def build_tables_func(spec: KernelSpec):
    from tvm.script.ir_builder import tirx as T

    with prim_func("build_tables") as ib:
        n, np_ = T.int32(), T.int32()
        lut_shape, ls_shape, xs_shape = spec.table_shapes(np_)
        X = arg("x", (n, spec.k))
        emit_tables(spec, X, arg("lut", lut_shape, "int8"), arg("ls", ls_shape), arg("xs", xs_shape), n, np_,
                    parallel=True)
    return ib.get()


def emit_tables(spec: KernelSpec, X, LUT, LS, XS, n, np_, parallel: bool = False) -> None:
    """The body of ``build_tables``, into the function being built; with ``parallel``, the rows of a batch of at
    least ``PARALLEL_TABLE_ROWS`` on the thread pool (a prefill's tables are otherwise a serial share of it)."""
    from tvm.script.ir_builder import tirx as T

    # the checks the Python wrappers make too; a raw call must still not write past the tables
    with T.Assert(n <= np_, "build_tables: the table buffers have fewer rows than the activations",
                  "ValueError"):
        if not parallel:
            with T.serial(0, n) as row:
                _emit_row(spec, X, LUT, LS, XS, row)
            return
        with T.If(n >= PARALLEL_TABLE_ROWS):
            with T.Then():
                with T.parallel(0, n) as row:
                    _emit_row(spec, X, LUT, LS, XS, row)
            with T.Else():
                with T.serial(0, n) as row:
                    _emit_row(spec, X, LUT, LS, XS, row)


def _emit_row(spec: KernelSpec, X, LUT, LS, XS, row) -> None:
    """The tables of activation row ``row``, with scratch buffers of its own (a parallel task's)."""
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    k, kp, lg, wg, codes = spec.k, spec.k_padded, spec.lut_group, spec.group_size, spec.layout.codes
    per = codes.per_table
    f32 = "float32"
    zero, half = tirx.FloatImm(f32, 0.0), tirx.FloatImm(f32, 0.5)
    # scratch buffers are "global" scope: TVM puts small global-scope buffers on the stack (registers, once
    # LLVM promotes them), but services "local" ones with a workspace allocation per use
    amax = T.alloc_buffer((1,), f32, scope="global")
    tv = min(16, lg // per)  # tables whose scale candidates are taken at once
    amaxv = T.alloc_buffer((tv,), f32, scope="global")
    lanes = T.alloc_buffer((16,), f32, scope="global")

    # coefficient vectors of the reference: entry p of a table is Σ_j coefs[j][p]·x_j (exact products)
    coefs = [constant([float(c) for c in column]) for column in codes.coefficients.T]

    def entries(xs):  # the 16 entries of the table of activations xs, in the reference's fp32 order
        return codes.table_sum([c * tirx.Broadcast(x, 16) for c, x in zip(coefs, xs)], tirx.Broadcast(half, 16))

    def largest(xa, lanes=1):  # the largest |entry| of a table (of `lanes` tables), from |x|
        return codes.largest(xa, half if lanes == 1 else tirx.Broadcast(half, lanes))

    def lut_group(g, padded: bool):
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

    with T.serial(0, k // lg) as g:
        lut_group(g, padded=False)
    if kp != k:  # triples pad K with zero activations, in the last lut group only
        lut_group(k // lg, padded=True)
    with T.serial(0, k // wg) as g:  # activation sums: 16 running lanes, then their total
        with T.vectorized(0, 16) as p:
            T.buffer_store(lanes, X[row, g * wg + p], [p])
        with T.serial(1, wg // 16) as i:
            with T.vectorized(0, 16) as p:
                T.buffer_store(lanes, lanes[p] + X[row, g * wg + i * 16 + p], [p])
        T.buffer_store(XS, tirx.FloatImm(f32, 0.0), [row, g])
        with T.serial(0, 16) as p:
            T.buffer_store(XS, XS[row, g] + lanes[p], [row, g])
