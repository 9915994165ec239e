"""Generate the LUT kernels of one ``KernelSpec`` as TIR, composing an ISA's primitives.

The functions of a spec (the weights' layout: ``tmac.quant.layout``; scales, tables, K chunks: ``tmac.execution.packing``):

- ``build_tables(X[N, K], LUT[N', K/4, 16], LS[N', K/LG], XS[N', K/WG])``: the int8 tables, their scales and
  the activation sums, in exactly the float operations of ``tmac.base.reference`` (``codegen/tables.py``);
- ``lut_gemm(W, S[, Z], LUT, LS, XS, Y[N, M])``: parallel over row blocks; per activation-row tile, per lut
  group, the unrolled inner loop loads each weight vector once and looks it up in the tables of every row of the
  tile (``n_tile`` rows), then a float epilogue applies table scale × weight scale and the ``(½s + z)·Σx`` term;
  up to ``FEW_ROWS`` rows (a decode step's sequences) every part's and tile's lut group follows the last, the
  weights read once and streamed as the GEMV's;
- ``lut_gemv(X[1, K], W, S[, Z], LUT, LS, XS, Y[1, M])``: one row, its tables built first in the same call (one
  call a projection: in a decode step whose weights stream from DRAM, each call into compiled code costs a few µs
  of Python state evicted from the caches), then the GEMM's loop with a tile of 1, a K chunk at a time.

Kernels are built with TVM's IR builder so that Python decides the shape of the code (chunks, vectors,
tiles are unrolled here); nothing is left for a schedule. The GEMV/GEMM is a driver (``emit_driver``: K chunks over
row blocks) over named emitters, nested as the loops they emit: ``emit_blocks`` (a row block and its tiles),
``emit_chunk`` (a K chunk's lut groups; K-quants' super groups), ``emit_lut_group`` (``emit_step``: the lookups,
then ``emit_epilogue``: the float sums), ``emit_store``.
"""

from __future__ import annotations

from tmac.base.formats import code_offset
from tmac.quant.spec import KernelSpec, packed_shapes

from tmac.codegen.grids import expanded_pairs
from tmac.quant.layout import SHIFT_MULTIPLIER
from tmac.codegen.tables import build_tables_func, emit_tables
from tmac.codegen.tir import arg, chunk_row, prefetch, prim_func
from tmac.codegen.vectors import vec

F32 = "float32"


GEMM_ROW_SPLITS = 4  # runs of activation-row tiles a GEMM's row block is split into, each a parallel task
# up to this many activation rows (a decode step's sequences, a short prompt) the GEMM reads each weight once for all
# its row tiles: every tile's lookups of a lut group (a super group) follow each other, while the weights are in L1,
# so the weights stream from DRAM while the added rows compute (block by block, tile by tile, the stream stalled
# while the later tiles read the block again from cache; docs/decisions.md, "Up to `FEW_ROWS` ... activation rows")
FEW_ROWS = 16


class _Gemm:
    """What the emitters of one ``lut_gemm``/``lut_gemv`` share: the spec's sizes, the ISA, the function's buffers
    (``declare``) and the loop variables of the block and row tile being emitted (``emit_blocks``)."""

    def __init__(self, spec: KernelSpec, isa, n_tile: int):
        from tvm import tirx

        self.spec, self.isa, self.n_tile, self.layout = spec, isa, n_tile, spec.layout
        self.k, self.lg, self.wg, self.bm, self.vl = spec.k, spec.lut_group, spec.group_size, spec.block_rows, \
            isa.vector_bytes
        self.u, self.steps = spec.unroll, spec.steps_per_lut_group
        self.lut_groups_per_wg = self.wg // self.lg
        # a tile's accumulators (vectors × activation rows) must stay in registers: with more than
        # ``isa.gemm_accumulators`` the block's rows are done in parts, each with its own float sums (a block's would
        # outgrow TVM's stack scratch; docs/decisions.md, "GEMM parts")
        parts, bm, vl = 1, self.bm, self.vl
        while sum(bm * p // vl for _, p in self.layout.chunks) * n_tile > isa.gemm_accumulators * parts \
                and bm // (2 * parts) % vl == 0:
            parts *= 2
        self.parts, self.sb = parts, bm // parts  # rows of a part
        # (first plane, planes, vectors in a part, byte offset of the chunk, rows per vector)
        self.chunks = [(o, p, self.sb * p // vl, bm * o, vl // p) for o, p in self.layout.chunks]
        self.ramp = tirx.Ramp(tirx.IntImm("int32", 0), tirx.IntImm("int32", 1), vl)
        self.sg = spec.super_groups
        self.shifts = self.layout.shifts  # IQ1's grid: shifts above its multipliers
        # K-quants (super scales): −(½s + z)·Σx = (offset − ½)·d·a·Σx − m·b·Σx, so a super group's terms are summed
        # with the multipliers a, b only, and d, m applied once at its end (per-group d·a and m·b − offset·d·a would
        # cost the epilogue more than the smaller parameters save); without zeros the term is −½·d·a·Σx, and
        # symmetric codes (codebooks) have none
        self.sum_coef = None if self.layout.codes.symmetric else \
            tirx.FloatImm(F32, (float(code_offset(spec.bits)) if spec.has_zeros else 0.0) - 0.5)

    # ---- values ---------------------------------------------------------------------------------------------------
    def u8(self, value):
        from tvm import tirx

        return tirx.Broadcast(tirx.IntImm("uint8", value), self.vl)

    def positions(self, planes):
        """Quads (tmac.quant.layout): in a quad chunk of P planes, byte p of a row's four holds plane p mod P of table
        p div P of the low nibbles' window of four tables and of the high nibbles'; with P = 1 those are the chunk's
        tables 0-3 and 4-7, with P = 2 both are its four tables, the high nibbles indexing the last two. The table
        within the window each lane's low and high nibble index."""
        from tvm import tirx

        vl = self.vl
        return [tirx.Cast(f"uint8x{vl}", ((self.ramp & tirx.Broadcast(tirx.IntImm("int32", 3), vl))
                                          // tirx.Broadcast(tirx.IntImm("int32", planes), vl) + first) << 4)
                for first in (0, 2 if planes == 2 else 0)]

    def nibbles(self, w, planes):
        """The two table indices in each byte."""
        from tvm import tirx

        if not self.layout.wide_lookup and self.isa.low_nibble_lookup:  # the high bits are not read: no masks,
            # and the high nibbles shifted as 16-bit lanes (a byte shift is a word shift and a mask)
            words = tirx.reinterpret(f"uint16x{self.vl // 2}", w) >> tirx.Broadcast(tirx.IntImm("uint16", 4),
                                                                                     self.vl // 2)
            return [tirx.reinterpret(f"int8x{self.vl}", w), tirx.reinterpret(f"int8x{self.vl}", words)]
        halves = [w & self.u8(15), w >> self.u8(4)]
        if not self.layout.wide_lookup:
            return [tirx.reinterpret(f"int8x{self.vl}", h) for h in halves]
        return [tirx.reinterpret(f"int8x{self.vl}", h | at) for h, at in zip(halves, self.positions(planes))]

    def negated_where(self, looked, mask):
        """−looked in the lanes whose flag is set (masked vpsubb on AVX-512)."""
        from tvm import tirx

        return tirx.Select(mask, tirx.Broadcast(tirx.IntImm("int8", 0), self.vl) - looked, looked)

    def chunk_row(self, blk, r, r0, rc):
        """Row r of block blk in the K chunk of rows [r0, r0 + rc) (``tir.chunk_row``)."""
        return chunk_row(self.mb, blk, r, r0, rc)

    def param(self, buf, blk, g, row, g0, gc):
        """A scale or zero (float16 parameters, and multipliers, widen in registers: vcvtph2ps, fcvtl)."""
        from tvm import tirx

        value = buf[self.param_at(blk, g, row, g0, gc)]
        if self.shifts and buf is self.SF:  # (IQ1's grid: its shifts above the multiplier)
            value = value & tirx.IntImm(buf.dtype, SHIFT_MULTIPLIER)
        return value if buf.dtype == F32 else tirx.Cast(F32, value)

    def param_at(self, blk, g, row, g0, gc):
        """Where weight group g's scale or zero (or multiplier) of block row ``row`` lies in S or Z, flat."""
        sg, bm = self.sg, self.bm
        if sg:  # [super group][multipliers of its SG groups, then F·BM bytes of d or m]
            return self.chunk_row(blk, g // sg, g0 // sg, gc // sg) * (sg + self.fb) * bm + g % sg * bm + row
        if self.s_shape[1] == 1:  # one scale a row: not chunked
            return blk * bm + row
        return self.chunk_row(blk, g, g0, gc) * bm + row

    # ---- emitters -------------------------------------------------------------------------------------------------
    def declare(self, tables: bool) -> None:
        """The function's arguments and flat views of them; with ``tables``, the table build first."""
        from tvm.script.ir_builder import tirx as T

        spec = self.spec
        self.mb, self.np_, self.n, self.m = mb, np_, n, m = T.int32(), T.int32(), T.int32(), T.int32()
        X = arg("x", (n, self.k)) if tables else None
        w_shape, self.s_shape = packed_shapes(spec, 1)
        s_shape = self.s_shape
        self.W = arg("w", (mb, *w_shape[1:]), "uint8")
        s_dtype, z_dtype = spec.param_dtypes
        self.S = arg("s", (mb, *s_shape[1:]), s_dtype)
        self.Z = arg("z", (mb, *s_shape[1:]), z_dtype) if spec.has_zeros else None
        lut_shape, ls_shape, xs_shape = spec.table_shapes(np_)
        LUT = arg("lut", lut_shape, "int8")
        self.LS = arg("ls", ls_shape)
        self.XS = arg("xs", xs_shape)
        self.Y = arg("y", (n, m))
        if tables:
            emit_tables(spec, X, LUT, self.LS, self.XS, n, np_)
        # a wide lookup (quads) serves 4 tables: 64 entries
        self.tw, self.lookup = (64, self.isa.lookup64) if self.layout.wide_lookup else (16, self.isa.lookup)
        self.tables_flat = T.decl_buffer((np_, lut_shape[1] * 16), "int8", data=LUT.data, align=1)
        steps_total, self.row_bytes = w_shape[1], w_shape[2]
        self.WF = T.decl_buffer((mb * steps_total * self.row_bytes,), "uint8", data=self.W.data, align=1)
        self.SF, self.ZF = (None if b is None else T.decl_buffer((mb * s_shape[1] * s_shape[2],), b.dtype,
                                                                 data=b.data, align=1) for b in (self.S, self.Z))
        if self.sg:  # the super scales, after each super group's multipliers (float16 ones widen in registers)
            self.fb = fb = spec.super_bytes
            self.SS, self.ZS = (None if b is None else T.decl_buffer((mb * s_shape[1] * s_shape[2] // fb,),
                                                                     spec.scale_dtype, data=b.data, align=1)
                                for b in (self.S, self.Z))

    def emit_blocks(self, each_chunk, first, few: bool = False) -> None:
        """Every row block over the K chunks ``each_chunk`` emits (``first``: they start the sum; otherwise the
        block's rows start from Y). ``few``: at most ``FEW_ROWS`` rows, every tile of a block at once (``each_tile``)."""
        from tvm import tirx
        from tvm.script.ir_builder import tirx as T

        spec, n_tile, sb, sg = self.spec, self.n_tile, self.sb, self.sg
        # the GEMM's tasks: each row block's activation-row tiles in GEMM_ROW_SPLITS runs (a matrix of few blocks,
        # 576 rows, would otherwise keep some threads idle); each output still has one task and one order of sums
        splits = 1 if n_tile == 1 or few else GEMM_ROW_SPLITS
        tiles = self.np_ // n_tile
        per_split = (tiles + splits - 1) // splits
        with T.parallel(0, self.mb * splits) as task:
            blk = task // splits if splits > 1 else task
            self.blk = blk
            self.out = T.alloc_buffer((FEW_ROWS * self.bm if few else n_tile * sb,), F32, scope="global")  # (``at``)
            # K-quants: a super group's Σ a·(terms) and Σ b·Σx, per row of the tile
            self.sums = [T.alloc_buffer((n_tile * sb,), F32, scope="global")
                         for _ in range((2 if spec.has_zeros else 1) if sg else 0)]
            self.racc = T.alloc_buffer((sb,), "int32", scope="global")
            self.accs = [T.alloc_buffer((nv * n_tile,), self.isa.acc_dtype(p, self.steps), scope="global")
                         for _, p, nv, _, _ in self.chunks]
            # a weight read once (the GEMV's, a few rows') streams from DRAM: reading it a little ahead
            # (``Isa.prefetch_bytes``) keeps the stream going while the lookups compute, and farther ahead into L2
            # (``prefetch_l2_bytes``) keeps more lines in flight than L1's fill buffers hold (docs/decisions.md,
            # "The weight stream is prefetched"); the GEMM of many rows reads a block from cache once per row tile
            self.ahead = self.isa.prefetch_bytes if n_tile == 1 or few else 0
            self.ahead_l2 = self.isa.prefetch_l2_bytes if self.ahead else 0
            if few:
                self.tiles = tiles
                self.each_tile(lambda: self.emit_start(first))
                each_chunk(self.emit_chunk)
                self.each_tile(self.emit_store)
                return
            self.tiles, self.slot = None, 0
            with T.serial(0, per_split) as j:
                nt = self.nt = task % splits * per_split + j if splits > 1 else j
                parts = self.parts if splits == 1 else tirx.if_then_else(nt < tiles, self.parts, 0)  # (past the tiles)
                with T.serial(0, parts) as part:  # the block's rows, a part at a time
                    self.part, self.first_row = part, part * sb  # first row of the part in the block
                    self.emit_start(first)
                    each_chunk(self.emit_chunk)
                    self.emit_store()

    def emit_start(self, first) -> None:
        """The tile's float sums start at 0, or from Y (later chunks go on from Y: the float sums keep their order)."""
        from tvm import tirx
        from tvm.script.ir_builder import tirx as T

        for r in range(self.n_tile):
            row = self.nt * self.n_tile + r
            with T.serial(0, self.sb) as i:
                col = self.blk * self.bm + self.first_row + i
                y = tirx.if_then_else(tirx.all(tirx.Not(first), row < self.n, col < self.m),
                                      self.Y[row, col], tirx.FloatImm(F32, 0.0))
                T.buffer_store(self.out, y, [self.at(r, i)])

    def at(self, r, i):
        """Where row ``r`` of the tile, block row ``i`` of the part, keeps its float sum in ``out`` (the tile's
        ``slot``: 0, or with ``few`` its index, and then the part's rows among the block's)."""
        if self.tiles is None:
            return (self.slot * self.n_tile + r) * self.sb + i
        return (self.slot * self.n_tile + r) * self.bm + self.first_row + i

    def each_tile(self, body) -> None:
        """``body()`` for the tile being emitted, or (``few``) in a loop over every part and tile of the block, so
        that a lut group's weights are read together and the stream from DRAM keeps one pace (docs/decisions.md,
        "Up to `FEW_ROWS` ... activation rows")."""
        from tvm.script.ir_builder import tirx as T

        if self.tiles is None:
            body()
            return
        with T.serial(0, self.parts) as part:
            self.part, self.first_row = part, part * self.sb
            with T.serial(0, self.tiles) as nt:
                self.nt = self.slot = nt
                body()

    def emit_chunk(self, g0, gc) -> None:
        """Lut groups [g0, g0 + gc) of one K chunk: for K-quants a super group at a time, then its d and m."""
        from tvm.script.ir_builder import tirx as T

        sg = self.sg
        if not sg:
            with T.serial(0, gc) as gi:
                self.each_tile(lambda: self.emit_lut_group(g0 + gi, g0, gc))
            return
        with T.serial(0, gc // sg) as jj:
            self.each_tile(lambda: self.emit_super_group(g0 // sg + jj, g0, gc))

    def emit_super_group(self, j, g0, gc) -> None:
        """K-quants: super group j of the chunk's lut groups, summed with its multipliers, then times d and m."""
        from tvm import tirx
        from tvm.script.ir_builder import tirx as T

        sg, spec = self.sg, self.spec
        with T.vectorized(0, self.n_tile * self.sb) as i:
            for buf in self.sums:
                T.buffer_store(buf, tirx.FloatImm(F32, 0.0), [i])
        # two lut groups a body: the super group's sums then stay in registers (docs/decisions.md, "K-quants")
        with T.serial(0, sg // 2) as gio:
            with T.unroll(0, 2) as gii:
                self.emit_lut_group(j * sg + gio * 2 + gii, g0, gc)
        for r in range(self.n_tile):
            with T.vectorized(0, self.sb) as i:
                at = r * self.sb + i
                base = (self.chunk_row(self.blk, j, g0 // sg, gc // sg) * (sg + self.fb) + sg) * self.bm \
                    // self.fb + self.first_row + i
                d, m = (None if b is None else tirx.Cast(F32, b[base]) for b in (self.SS, self.ZS))
                if spec.super_exponent:  # stored times 2^e (exact either way: a power of two)
                    d, m = (None if v is None else v * tirx.FloatImm(F32, 2.0 ** -spec.super_exponent) for v in (d, m))
                total = d * self.sums[0][at]
                if self.Z is not None:
                    total = total - m * self.sums[1][at]
                T.buffer_store(self.out, self.out[self.at(r, i)] + total, [self.at(r, i)])

    def emit_lut_group(self, g, g0, gc) -> None:
        """The weights of lut group g of the chunk [g0, g0 + gc): integer sums, then the float epilogue."""
        from tvm import tirx
        from tvm.script.ir_builder import tirx as T

        for (_, p, nv, _, _), acc in zip(self.chunks, self.accs):
            elem, lanes = self.isa.acc_dtype(p, self.steps).split("x")
            for a in range(nv * self.n_tile):
                T.buffer_store(acc, tirx.Broadcast(tirx.IntImm(elem, 0), int(lanes)), [a])
        with T.serial(0, self.steps // self.u) as kpo:
            with T.unroll(0, self.u) as kpi:
                self.emit_step(g * self.steps + kpo * self.u + kpi, g0, gc)
        self.emit_epilogue(g, g0, gc)

    def emit_step(self, step, g0, gc) -> None:
        """One inner-loop step: each weight vector loaded once, looked up in the tables of every row of the tile."""
        from tvm.script.ir_builder import tirx as T

        isa, layout, n_tile, vl, bm = self.isa, self.layout, self.n_tile, self.vl, self.bm

        def byte_at(start):  # flat index in W of the block's ``step`` (a global index)
            return self.chunk_row(self.blk, step, g0 * self.steps, gc * self.steps) * self.row_bytes + start

        def weights(start, lanes):
            return self.WF[vec(byte_at(start), lanes)]

        for j, (t_lo, t_hi, base, qp, first_plane) in enumerate(layout.lookups(step, bm)):
            tables = [tuple(self.tables_flat[self.nt * n_tile + r, vec(t * 16, self.tw)] for t in (t_lo, t_hi))
                      for r in range(n_tile)]
            stored = layout.stored_bytes(vl)  # a weight vector's bytes in W (a grid's: half)
            for (_, p, nv, off, _), acc in zip(self.chunks, self.accs):
                for v in range(nv):
                    vb = self.part * nv + v  # the vector in the block
                    start, rel = base + off + vb * stored, base + off + v * stored  # (rel: within the part's)
                    for line in range(-(-rel // 64) * 64, rel + stored, 64) if self.ahead else ():  # lines begun here
                        prefetch(self.WF, byte_at(start - rel + line + self.ahead))
                        if self.ahead_l2:
                            prefetch(self.WF, byte_at(start - rel + line + self.ahead_l2), level=2)
                    if self.spec.grid:  # a pair of vectors from one load (a part has whole pairs: 4 vectors)
                        group = 4 if layout.entries == 1 and nv % 4 == 0 else 2  # (IQ2: two pairs share lookups)
                        if v % group == 0:
                            shifts = None
                            if self.shifts:  # the pairs' rows' multiplier bytes of the step's group
                                per, lpw = self.spec.group_size // 8, self.lut_groups_per_wg
                                at = self.param_at(self.blk, step // per, vb * vl // 4, g0 // lpw, gc // lpw)
                                shifts = (self.SF[vec(at, vl // 4 * group)], step % per)
                            expanded = [T.bind(c) for c in expanded_pairs(
                                isa, layout, self.WF, [byte_at(start + 2 * stored * q) for q in range(group // 2)],
                                shifts)]
                        codes = expanded[v % group]
                    else:
                        codes = weights(start, vl)
                    idx = self.nibbles(codes, qp)
                    masks = [isa.lane_mask(weights(layout.mask_start(j, vb, h, bm, vl), vl // 8))
                             for h in (0, 1)] if layout.codes.negated else None
                    for r, t_pair in enumerate(tables):
                        looked = [self.lookup(t, i) for t, i in zip(t_pair, idx)]
                        if masks is not None:
                            looked = [self.negated_where(x, mk) for x, mk in zip(looked, masks)]
                        a = v * n_tile + r
                        T.buffer_store(acc, isa.accumulate(acc[a], looked, p, qp or p, first_plane), [a])

    def emit_epilogue(self, g, g0, gc) -> None:
        """Lut group g's integer sums widened to int32 per row, times table scale and weight scale into the float
        sums; at a weight group's end its ``(½s + z)·Σx`` term."""
        from tvm import tirx
        from tvm.script.ir_builder import tirx as T

        spec, sb, sg, racc, out = self.spec, self.sb, self.sg, self.racc, self.out
        lpw = self.lut_groups_per_wg
        wgi = g // lpw if spec.k_padded == spec.k else 0  # K padded to whole lut groups: one weight group
        wg0, wgc = g0 // lpw, gc // lpw  # the chunk's weight groups

        def param(buf, i):
            return self.param(buf, self.blk, wgi, self.first_row + i, wg0, wgc)

        for r in range(self.n_tile):
            row = self.nt * self.n_tile + r
            for ci, ((o, p, nv, _, per_vec), acc) in enumerate(zip(self.chunks, self.accs)):
                rows = self.isa.acc_rows(p)  # lanes → rows of the block, where not in order
                for v in range(nv):
                    lanes = acc[v * self.n_tile + r]
                    if rows is not None:
                        lanes = tirx.Shuffle([lanes], [rows.index(i) for i in range(per_vec)])
                    wide = self.isa.widen(lanes, p)
                    if o:
                        wide = wide << tirx.Broadcast(tirx.IntImm("int32", o), per_vec)
                    if ci:
                        wide = racc[vec(v * per_vec, per_vec)] + wide
                    T.buffer_store(racc, wide, [vec(v * per_vec, per_vec)])
            # a lut group that is a whole weight group takes its Σx term along: s·(R·ls − ½Σx) − z·Σx, one pass
            # over the sums and one read of each scale (its own pass was a third of the GEMM's float work)
            whole = not sg and lpw == 1 and not self.layout.codes.symmetric
            with T.vectorized(0, sb) as i:
                at, ot = r * sb + i, self.at(r, i)  # (the super group's sums are the tile's alone)
                if sg:  # a lut group is a weight group (KernelSpec): a's terms in one
                    term = tirx.Cast(F32, racc[i]) * self.LS[row, g]
                    if self.sum_coef is not None:  # (codebooks: symmetric codes, no Σx term)
                        term = term + self.sum_coef * self.XS[row, wgi]
                    T.buffer_store(self.sums[0], self.sums[0][at] + term * param(self.SF, i), [at])
                elif whole:
                    term = tirx.Cast(F32, racc[i]) * self.LS[row, g] - tirx.FloatImm(F32, 0.5) * self.XS[row, wgi]
                    total = out[ot] + param(self.SF, i) * term
                    if self.Z is not None:
                        total = total - param(self.ZF, i) * self.XS[row, wgi]
                    T.buffer_store(out, total, [ot])
                else:
                    T.buffer_store(out, out[ot] + tirx.Cast(F32, racc[i]) * (self.LS[row, g] * param(self.SF, i)),
                                   [ot])
            if self.layout.codes.symmetric or whole:  # ternary triples: no Σx term; or it came along
                continue
            if sg and self.Z is None:  # the Σx term rode with a's (sum_coef)
                continue
            with T.If(g % lpw == lpw - 1):
                with T.Then():
                    with T.vectorized(0, sb) as i:
                        at, ot = r * sb + i, self.at(r, i)
                        if sg:
                            T.buffer_store(self.sums[1], self.sums[1][at] + param(self.ZF, i) * self.XS[row, wgi],
                                           [at])
                        else:
                            half_s = tirx.FloatImm(F32, 0.5) * param(self.SF, i)
                            coef = half_s + param(self.ZF, i) if self.Z is not None else half_s
                            T.buffer_store(out, out[ot] - coef * self.XS[row, wgi], [ot])

    def emit_store(self) -> None:
        """The tile's float sums into Y, inside its bounds."""
        from tvm.script.ir_builder import tirx as T

        for r in range(self.n_tile):
            row = self.nt * self.n_tile + r
            with T.If(row < self.n):
                with T.Then():
                    with T.serial(0, self.sb) as i:
                        col = self.blk * self.bm + self.first_row + i
                        with T.If(col < self.m):
                            with T.Then():
                                T.buffer_store(self.Y, self.out[self.at(r, i)], [row, col])

    def emit_driver(self, name: str) -> None:
        """The K chunks over the row blocks: the GEMV a chunk at a time over all blocks, the GEMM every chunk of a
        block in turn."""
        from tvm import tirx
        from tvm.script.ir_builder import tirx as T

        spec, n_tile = self.spec, self.n_tile
        with T.Assert(tirx.all(self.n <= self.np_, self.np_ % n_tile == 0),
                      f"{name}: the tables must cover every output row in whole tiles of {n_tile}", "ValueError"):
            groups_total, groups_per_chunk = spec.k_padded // self.lg, spec.k_chunk // self.lg
            full, tail = divmod(groups_total, groups_per_chunk)
            if n_tile == 1:
                # the GEMV streams each weight once: a chunk at a time over all blocks, in one parallel launch (TVM
                # splits a parallel loop inside a launch point statically: each thread takes the same blocks of
                # every chunk, so no chunk waits for another thread); the chunk sizes are constants (the shorter
                # last chunk its own code: a computed size was slower; docs/decisions.md, "K chunks")
                with T.attr(tirx.const(0, "int32"), "pragma_parallel_launch_point", tirx.const(1, "int32")):
                    with T.serial(0, full) as c:
                        self.emit_blocks(lambda emit, c=c: emit(c * groups_per_chunk, groups_per_chunk), c == 0)
                    if tail:
                        self.emit_blocks(lambda emit: emit(full * groups_per_chunk, tail),
                                         tirx.const(full == 0, "bool"))
            else:
                # the GEMM of many rows reads a block's weights once per row tile, from cache; of a few, once: every
                # chunk of a block in turn, one code for all (a second copy of the unrolled body for the last chunk
                # was slower)
                def every_chunk(emit):
                    with T.serial(0, full + (tail > 0)) as c:
                        g0 = c * groups_per_chunk
                        emit(g0, tirx.min(groups_per_chunk, groups_total - g0))

                with T.If(self.np_ <= FEW_ROWS):
                    with T.Then():
                        self.emit_blocks(every_chunk, tirx.const(True, "bool"), few=True)
                    with T.Else():
                        self.emit_blocks(every_chunk, tirx.const(True, "bool"))


def lut_gemm_func(spec: KernelSpec, isa, n_tile: int, name: str, tables: bool = False):
    """``lut_gemm``, or with ``tables`` (``lut_gemv``) taking the activations ``x`` first and building the tables
    itself, as ``build_tables`` would."""
    gemm = _Gemm(spec, isa, n_tile)
    with prim_func(name) as ib:
        gemm.declare(tables)
        gemm.emit_driver(name)
    return ib.get()


def module(spec: KernelSpec, isa):
    """The IRModule of one spec: ``build_tables``, ``lut_gemv`` and ``lut_gemm``, and where it has them the
    dot-product GEMM's ``quantize_rows`` and ``dot_gemm``."""
    import tvm

    from tmac.codegen import dot

    funcs = {"build_tables": build_tables_func(spec),
             "lut_gemv": lut_gemm_func(spec, isa, 1, "lut_gemv", tables=True),
             "lut_gemm": lut_gemm_func(spec, isa, spec.n_tile, "lut_gemm")}
    if spec.dot_products:
        funcs.update(quantize_rows=dot.quantize_rows_func(spec), dot_gemm=dot.dot_gemm_func(spec, isa))
    return tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
