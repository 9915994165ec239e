"""Generate the dot-product kernels of one ``KernelSpec``: the path for many activation rows (a prefill), where table
lookups cost more than multiplying.

- ``quantize_rows(X[N, K], XQ[N', K], XD[N', K/B], XS[N', K/WG])``: each block of B activations of a row
  (``KernelSpec.activation_block``: 32, or a K-quant's super group of 256 as llama.cpp's Q8_K) as int8 with one
  float32 scale (``qx = rint(x·127/amax)``, ``d = amax/127``: ``tmac.base.reference.quantize_activations``), and
  each weight group's sum of the rounded activations times d (``quantized_sums``);
- ``dot_gemm(W, S[, Z], XQ, XD, XS, Y[N, M])``: parallel over parts of row blocks; each part's bit planes unpacked
  once into a byte per weight, four consecutive weights a 32-bit lane (the dot-product instructions' order), then per
  tile of activation rows and per 32 (or 16) activations an integer dot product (``Isa.dot``: ``vpdpbusd``,
  ``vpmaddubsw``) and the LUT kernels' float epilogue: times activation scale and weight scale, minus the
  ``(s·offset + z)·Σx`` term. K-quants: each group's sums times its multiplier a add up in integers over the super
  group (``Isa.dot_scaled``: ``vpmaddwd`` with a, ``vpmulld``), and d·dx multiplies once a super group; the
  Σx term takes the multipliers b (or a·offset) and dmin (or d) apart.

The weights are the LUT kernels' own (``Planes``: chunks of 4, 2 and 1 planes): nothing is stored twice. The numpy oracle is
``tmac.base.reference.dot_matmul``.
"""

from __future__ import annotations

from tmac.base.formats import code_offset
from tmac.base.reference import QUANT_BLOCK
from tmac.quant.spec import KernelSpec, packed_shapes

from tmac.codegen.tir import arg, chunk_row, prim_func
from tmac.codegen.grids import expanded_pairs
from tmac.quant.layout import SHIFT_MULTIPLIER
from tmac.codegen.vectors import constant, f32, fold, vec

F32 = "float32"
UNROLLED_UNITS = 4  # a weight group of up to this many integer sums is emitted straight, a longer one as a loop


def quantize_rows_func(spec: KernelSpec):
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    k, qb = spec.k, spec.activation_block
    unit = min(spec.group_size, QUANT_BLOCK)
    with prim_func("quantize_rows") as ib:
        n, np_ = T.int32(), T.int32()
        X = arg("x", (n, k))
        XQ, XD = arg("xq", (np_, k), "int8"), arg("xd", (np_, k // qb))
        XS = arg("xs", (np_, k // unit))
        zero = f32(0.0)
        with T.Assert(n <= np_, "quantize_rows: the buffers have fewer rows than the activations", "ValueError"):
            with T.parallel(0, n) as row:
                with T.serial(0, k // qb) as b:
                    # a block in pieces of a sum's activations (a vector of 256 lanes took LLVM seconds to compile)
                    pieces = [X[row, tirx.Ramp(b * qb + h * unit, 1, unit)] for h in range(qb // unit)]
                    top = tirx.abs(pieces[0])
                    for piece in pieces[1:]:
                        top = tirx.max(top, tirx.abs(piece))
                    amax = T.bind(fold(top, unit, tirx.max))
                    inv = T.bind(tirx.Select(amax > zero, f32(127.0) / amax, zero))
                    d = T.bind(amax / f32(127.0))
                    T.buffer_store(XD, d, [row, b])
                    for h, piece in enumerate(pieces):
                        q = T.bind(tirx.Cast(f"int8x{unit}", tirx.nearbyint(piece * tirx.Broadcast(inv, unit))))
                        T.buffer_store(XQ, q, [row, tirx.Ramp(b * qb + h * unit, 1, unit)])
                        # the Σx terms' sums, of the rounded activations (reference.quantized_sums); LLVM's own
                        # reduction: the same sum as a fold of shuffles took it seconds to compile
                        total = tirx.call_llvm_pure_intrin("int32", "llvm.vector.reduce.add",
                                                           tirx.Cast(f"int32x{unit}", q))
                        T.buffer_store(XS, tirx.Cast(F32, total) * d, [row, b * (qb // unit) + h])
    return ib.get()


class _DotGemm:
    """What the emitters of one ``dot_gemm`` share: sizes, ISA, buffers and the loop variables being emitted."""

    def __init__(self, spec: KernelSpec, isa):
        self.spec, self.isa = spec, isa
        self.k, self.wg, self.bm, self.vl = spec.k, spec.group_size, spec.block_rows, isa.vector_bytes
        self.lanes = self.vl // 4  # weight rows a vector holds: four bytes (activations) a row
        # vectors of weight rows, activation rows: a tile's accumulators
        self.r, self.c = isa.dot_tile_of(spec)
        while self.bm % (self.r * self.lanes):
            self.r //= 2
        self.rows = self.r * self.lanes  # weight rows of a part (a task's)
        self.unit = min(self.wg, QUANT_BLOCK)  # activations an integer sum covers: a weight group or a block
        self.qb = spec.activation_block
        self.sg = spec.super_groups
        self.shifts = spec.layout.shifts  # IQ1's grid: shifts above its multipliers
        if self.sg and self.unit != self.wg:
            raise ValueError(f"{spec.name}: a super group's weight groups must be one integer sum each")
        # codes less their offset, where the ISA multiplies signed bytes and the format has no zeros (whose
        # K-quant form d·a·q − dmin·b takes the codes as stored): no offset term in the epilogue. A codebook's
        # codes become its levels (signed), or the levels + 128 as unsigned bytes (offset 128)
        self.signed = isa.dot_signed_codes and not spec.has_zeros or bool(spec.codebook) and isa.dot_signed_levels
        self.offset = 0.0 if self.signed else 128.0 if spec.codebook else float(code_offset(spec.bits))
        self.sum_term = bool(self.offset) or spec.has_zeros  # a Σx term at all (none: signed codes without zeros)
        # a codebook's levels as ``dot`` takes them, and the weight bytes' largest magnitude where not the codes'
        # own (2^bits − 1)
        self.levels = [v if self.signed else v + 128 for v in spec.codebook] if spec.codebook else None
        self.largest = max(abs(v) for v in self.levels) if self.levels else None
        if self.levels and self.signed and min(self.levels) < -127:  # (|−128| is not a byte)
            raise ValueError(f"{spec.name}: a codebook level of −128 cannot be multiplied as a signed byte")

    def declare(self):
        from tvm.script.ir_builder import tirx as T

        spec = self.spec
        self.mb, self.np_, self.n, self.m = mb, np_, n, m = T.int32(), T.int32(), T.int32(), T.int32()
        w_shape, s_shape = packed_shapes(spec, 1)
        self.s_shape = s_shape
        W = arg("w", (mb, *w_shape[1:]), "uint8")
        s_dtype, z_dtype = spec.param_dtypes
        S = arg("s", (mb, *s_shape[1:]), s_dtype)
        Z = arg("z", (mb, *s_shape[1:]), z_dtype) if spec.has_zeros else None
        self.XQ = arg("xq", (np_, self.k), "int8")
        self.XD = arg("xd", (np_, self.k // self.qb))
        self.XS = arg("xs", (np_, self.k // self.unit))
        self.Y = arg("y", (n, m))
        self.steps, self.row_bytes = w_shape[1], w_shape[2]
        size = mb * self.steps * self.row_bytes
        self.W32 = T.decl_buffer((size // 4,), "uint32", data=W.data, align=1)
        self.W16 = T.decl_buffer((size // 2,), "uint16", data=W.data, align=1)
        self.W8 = T.decl_buffer((size,), "uint8", data=W.data, align=1)
        self.X32 = T.decl_buffer((np_ * self.k // 4,), "int32", data=self.XQ.data, align=1)
        flat = mb * s_shape[1] * s_shape[2]
        self.SF = T.decl_buffer((flat,), S.dtype, data=S.data, align=1)
        self.ZF = None if Z is None else T.decl_buffer((flat,), Z.dtype, data=Z.data, align=1)
        if self.sg:
            fb = self.fb = spec.super_bytes
            self.SS, self.ZS = (None if b is None else T.decl_buffer((flat // fb,), spec.scale_dtype, data=b.data,
                                                                     align=1) for b in (S, Z))

    # ---- values ---------------------------------------------------------------------------------------------------
    def flat_row(self, rows: int, index):
        """Where row ``index`` of the part's block lies among an array's ``[MB, rows, X]`` rows (steps, weight or super
        groups) stored in K-chunk order (``tmac.execution.packing.chunk_views``): chunk c's rows of every block
        after the chunks before it, the last chunk possibly shorter."""
        from tvm import tirx

        per = rows * self.spec.k_chunk // self.spec.k_padded
        if rows == 1 or per >= rows:
            return self.blk * rows + index
        r0 = index // per * per  # the chunk of ``index``, found at run time: the tile loops run over all of K
        return chunk_row(self.mb, self.blk, index, r0, tirx.min(per, rows - r0))

    def param(self, buf, g, r, dtype=F32):
        """``dtype`` x lanes: scale or zero (or multiplier) of weight group g for vector r of the part."""
        from tvm import tirx

        L = self.lanes
        v = buf[vec(self.param_at(g, self.first + r * L), L)]
        if self.shifts and buf is self.SF:  # (IQ1's grid: its shifts above the multiplier)
            v = v & tirx.Broadcast(tirx.IntImm(buf.dtype, SHIFT_MULTIPLIER), L)
        return v if buf.dtype == dtype else tirx.Cast(f"{dtype}x{L}", v)

    def param_at(self, g, row):
        """Where weight group g's scale or zero (or multiplier) of block row ``row`` lies in S or Z, flat."""
        sg, bm = self.sg, self.bm
        if sg:
            return self.flat_row(self.s_shape[1], g // sg) * ((sg + self.fb) * bm) + g % sg * bm + row
        return self.flat_row(self.s_shape[1], g) * bm + row

    def super_param(self, buf, j, r):
        from tvm import tirx

        sg, bm, L = self.sg, self.bm, self.lanes
        base = self.flat_row(self.s_shape[1], j) * (sg + self.fb) + sg
        v = buf[vec(base * bm // self.fb + self.first + r * L, L)]
        v = v if buf.dtype == F32 else tirx.Cast(f"float32x{L}", v)
        if self.spec.super_exponent:  # stored times 2^e (exact either way: a power of two)
            v = v * self.bcast(tirx.FloatImm(F32, 2.0 ** -self.spec.super_exponent))
        return v

    def bcast(self, value):
        from tvm import tirx

        return tirx.Broadcast(value, self.lanes)

    # ---- emitters -------------------------------------------------------------------------------------------------
    def emit_unpack(self, P) -> None:
        """The part's codes into P ``[K/4, rows]`` uint32: lane = row, byte j = code of activation 4·kk + j. In a
        chunk of P planes a row's plane bytes of a step are one P-byte word (rows in order, ``Planes``); the bits of
        activation 8·step + j are bit j of each byte. Four planes: the nibble of four activations in each plane byte,
        a 4 × 4 bit matrix (byte = plane, bit = activation), transposed by two masked swaps (``transposed``); two
        planes: ``t | t >> 7`` of ``t = (w >> j) & 0x0101`` in bits 0-1; one: ``(w >> j) & 1``."""
        from tvm import tirx
        from tvm.script.ir_builder import tirx as T

        rows = self.rows

        def u32(value):
            return tirx.Broadcast(tirx.IntImm("uint32", value), rows)

        def transposed(v):
            # bit 8k + j → bit 8j + k (k, j < 4): the 2 × 2 blocks swapped (delta 14), then the bits in each (7)
            for mask, delta in ((0x00000C0C, 14), (0x000A000A, 7)):
                t = T.bind((v ^ (v >> u32(delta))) & u32(mask))
                v = v ^ t ^ (t << u32(delta))
            return v

        for r0, count in self.spec.chunk_ranges(self.steps):  # (K chunks: tmac.execution.packing)
            if self.spec.codebook:
                self.emit_levels(P, r0, count, u32)
            else:
                self.emit_unpack_steps(P, r0, count, u32, transposed)

    def emit_levels(self, P, r0: int, count: int, u32) -> None:
        """Codebook codes (``CodebookCodes``) of steps r0 .. r0 + count − 1 into P as their levels (+ 128 where
        ``dot`` takes unsigned bytes), looked up a weight vector at a time in the 16 levels. Quads: a row's word
        a step, the low nibble of byte j the code of activation 8·step + j, the high one of 8·step + 4 + j; planes:
        a row's byte a step, the codes of activations 2·step (low nibble) and 2·step + 1."""
        from tvm import tirx
        from tvm.script.ir_builder import tirx as T

        rows, L = self.rows, self.lanes
        table = constant([v - 256 if v > 127 else v for v in self.levels], "int8")

        def store(word, kk):
            for r in range(self.r):
                part = tirx.reinterpret(f"int8x{self.vl}", tirx.Shuffle([word], list(range(r * L, (r + 1) * L))))
                looked = tirx.reinterpret(f"uint32x{L}", self.isa.lookup(table, part))
                T.buffer_store(P, looked, [vec(kk * rows + r * L, L)])

        def at(s):  # the part's first byte of step s
            return self.flat_row(self.steps, s) * self.row_bytes + self.first * self.row_bytes // self.bm

        nibbles = u32(0x0F0F0F0F)
        if self.spec.quads:
            with T.serial(0, count) as i:
                if self.spec.grid:  # each pair of vectors' rows expanded from their indices and signs
                    if rows % (2 * L):
                        raise ValueError(f"{self.spec.name}: a dot tile of grid codes needs whole vector pairs")
                    layout = self.spec.layout
                    stored = layout.stored_bytes(self.vl)
                    group = 4 if layout.entries == 1 and rows // L % 4 == 0 else 2  # (IQ2: two pairs share lookups)
                    per = self.spec.group_size // 8  # (IQ1: the steps of a group, whose multipliers hold shifts)
                    codes = [c for v in range(0, rows // L, group)
                             for c in expanded_pairs(
                                 self.isa, layout, self.W8,
                                 [at(r0 + i) + (v + 2 * q) * stored for q in range(group // 2)],
                                 (self.SF[vec(self.param_at((r0 + i) // per, self.first + v * L), L * group)],
                                  (r0 + i) % per) if self.shifts else None)]
                    word = T.bind(tirx.Shuffle([tirx.reinterpret(f"uint32x{L}", c) for c in codes],
                                               list(range(rows))))
                else:
                    word = T.bind(self.W32[vec(at(r0 + i) // 4, rows)])
                store(word & nibbles, 2 * (r0 + i))
                store((word >> u32(4)) & nibbles, 2 * (r0 + i) + 1)
            return
        with T.serial(0, count // 2) as i:
            b0, b1 = (T.bind(tirx.Cast(f"uint32x{rows}", self.W8[vec(at(r0 + 2 * i + h), rows)])) for h in (0, 1))
            low = u32(0x0F)
            word = (b0 & low) | ((b0 >> u32(4)) << u32(8)) | ((b1 & low) << u32(16)) | ((b1 >> u32(4)) << u32(24))
            store(word, (r0 + 2 * i) // 2)

    def emit_unpack_steps(self, P, r0: int, count: int, u32, transposed) -> None:
        """Steps r0 .. r0 + count − 1 of the part (one K chunk) into P."""
        from tvm import tirx
        from tvm.script.ir_builder import tirx as T

        rows, bm = self.rows, self.bm
        with T.serial(0, count) as i:
            s = r0 + i
            step = self.flat_row(self.steps, s) * self.row_bytes  # the block's step, in bytes
            words = []
            for first, planes in self.spec.layout.chunks:
                at = step + bm * first + self.first * planes
                if planes == 4:
                    words.append((first, planes, self.W32[vec(at // 4, rows)]))
                else:
                    buf = self.W16 if planes == 2 else self.W8
                    words.append((first, planes, tirx.Cast(f"uint32x{rows}", buf[vec(at // planes, rows)])))
            for half in (0, 1):
                out = None
                for first, planes, word in words:
                    if planes == 4:
                        t = [transposed((word >> u32(4 * half)) & u32(0x0F0F0F0F)) << u32(first)]
                    else:
                        t = []
                        for j in range(4):
                            b = (word >> u32(4 * half + j)) & u32(0x0101 if planes == 2 else 1)
                            if planes == 2:
                                b = (b | (b >> u32(7))) & u32(3)
                            t.append(b << u32(8 * j + first))
                    for b in t:
                        out = b if out is None else out | b
                if self.signed:
                    lanes = 4 * rows
                    out = tirx.reinterpret(f"uint32x{rows}", tirx.reinterpret(f"int8x{lanes}", out) - tirx.Broadcast(
                        tirx.IntImm("int8", code_offset(self.spec.bits)), lanes))
                T.buffer_store(P, out, [vec((2 * s + half) * rows, rows)])

    def sum_span(self) -> int:
        """4-activation steps an accumulator sums before it is widened: the whole unit, or where its sums would
        overflow int16 but fewer steps' do not (5 and 6 bits without VNNI), the most that fit: ``vpmaddubsw``
        pairs add as int16 and one ``vpmaddwd`` widens (and scales) them, instead of widening every step."""
        quads = span = self.unit // 4
        def int16(n):
            return self.isa.dot_acc_dtype(self.spec.bits, n, self.largest).startswith("int16")
        while span > 1 and not int16(span):
            span //= 2
        return span if int16(span) else quads

    def emit_tile(self, P, n0) -> None:
        """Activation rows n0 .. n0 + C − 1 against the part's rows: float sums in F, then into Y."""
        from tvm import tirx
        from tvm.script.ir_builder import tirx as T

        r_, c_, L, rows, unit, wg, sg = self.r, self.c, self.lanes, self.rows, self.unit, self.wg, self.sg
        isa = self.isa
        span = self.sum_span()
        elem, acc_lanes = isa.dot_acc_dtype(self.spec.bits, span, self.largest).split("x")
        F = T.alloc_buffer((c_ * rows,), F32, scope="global")
        zero = f32(0.0)
        with T.vectorized(0, c_ * rows) as i:
            T.buffer_store(F, zero, [i])

        def at(c, r):
            return vec(c * rows + r * L, L)

        def unit_sums(g, u):
            """The integer sums of unit u of weight group g, one per (weight vector, activation row), in pieces of
            ``span`` 4-activation steps: a list of expressions a piece, not buffers (LLVM keeps them in
            registers)."""
            pieces = []
            kk0 = (g * wg + u * unit) // 4
            for q in range(unit // 4):
                if q % span == 0:
                    pieces.append([tirx.Broadcast(tirx.IntImm(elem, 0), int(acc_lanes))] * (r_ * c_))
                acc = pieces[-1]
                kk = kk0 + q
                # each weight vector loaded once for the tile's activation rows (a bound value, not a load
                # repeated in every accumulator's expression)
                ws = [T.bind(tirx.reinterpret(f"int8x{self.vl}", P[vec(kk * rows + r * L, L)]))
                      for r in range(r_)]
                if isa.dot_lane_activations and q % L == 0:  # the next L steps' words of each activation row
                    words = [T.bind(self.X32[vec((n0 + c) * (self.k // 4) + kk, L)]) for c in range(c_)]
                for c in range(c_):
                    if isa.dot_lane_activations:
                        xb = tirx.reinterpret(f"int8x{self.vl}", tirx.Shuffle([words[c]], [q % L] * L))
                    else:
                        xb = tirx.reinterpret(f"int8x{self.vl}",
                                              tirx.Broadcast(self.X32[(n0 + c) * (self.k // 4) + kk], L))
                    for r in range(r_):
                        a = r * c_ + c
                        acc[a] = T.bind(isa.dot(acc[a], ws[r], xb, self.signed))
            return pieces

        def float_unit(g, u):
            # the parameters once a unit for every activation row, and the unit's Σx term along:
            # s·(Σcq·d) − (s·offset + z)·Σq·d; with 32 registers s·(Σcq·d − offset·Σq·d) − z·Σq·d, one multiply
            # and one add less a sum without zeros (AVX2's 16 registers spill the shifted sums: slower there)
            acc = unit_sums(g, u)
            first = g * wg + u * unit
            fold = isa.vector_registers >= 32
            scales = [T.bind(self.param(self.SF, g, r)) for r in range(r_)]
            zeros = [T.bind(self.param(self.ZF, g, r)) for r in range(r_)] if self.ZF is not None else None
            offset = self.bcast(f32(self.offset))
            term = self.sum_term
            coefs = None if fold or not term else \
                [T.bind(scales[r] * offset if zeros is None else scales[r] * offset + zeros[r]) for r in range(r_)]
            for c in range(c_):
                xd = self.bcast(self.XD[n0 + c, first // self.qb])
                xs = T.bind(self.bcast(self.XS[n0 + c, first // unit])) if term else None
                shift = T.bind(xs * self.bcast(f32(-self.offset))) if fold and self.offset else None
                for r in range(r_):
                    a = r * c_ + c
                    total = isa.dot_widen(acc[0][a])
                    for piece in acc[1:]:
                        total = total + isa.dot_widen(piece[a])
                    val = tirx.Cast(f"float32x{L}", total) * xd
                    if not term:
                        out = F[at(c, r)] + scales[r] * val
                    elif not fold:
                        out = F[at(c, r)] + scales[r] * val - coefs[r] * xs
                    else:
                        out = F[at(c, r)] + scales[r] * (val if shift is None else val + shift)
                        out = out if zeros is None else out - zeros[r] * xs
                    T.buffer_store(F, out, [at(c, r)])

        groups = self.k // wg
        if not sg:
            with T.serial(0, groups) as g:
                units = wg // unit
                if units <= UNROLLED_UNITS:
                    for u in range(units):
                        float_unit(g, u)
                else:  # a long group (a whole row): a loop, or the kernel's code grows with K
                    with T.serial(0, units) as u:
                        float_unit(g, u)
        else:
            self.emit_super_groups(F, n0, unit_sums, at)
        for c in range(c_):
            with T.If(n0 + c < self.n):
                with T.Then():
                    with T.serial(0, rows) as i:
                        col = self.blk * self.bm + self.first + i
                        with T.If(col < self.m):
                            with T.Then():
                                T.buffer_store(self.Y, F[c * rows + i], [n0 + c, col])

    def emit_super_groups(self, F, n0, unit_sums, at) -> None:
        """K-quants, one activation scale dx a super group (``activation_block``): each group's integer sums times
        its multiplier a summed in integers (``Isa.dot_scaled``), the Σx term Σ b·Σq·dx (zeros) or offset·Σ a·Σq·dx
        apart, then once a super group ``d·dx·Σ a·Σcq − m·Σ b·xs`` (or ``d·offset·Σ a·xs``) into F."""
        from tvm import tirx
        from tvm.script.ir_builder import tirx as T

        r_, c_, L, rows, sg = self.r, self.c, self.lanes, self.rows, self.sg
        sums = T.alloc_buffer((c_ * rows,), "int32", scope="global")
        with T.serial(0, self.k // self.wg // sg) as j:
            with T.vectorized(0, c_ * rows) as i:
                T.buffer_store(sums, tirx.IntImm("int32", 0), [i])
            with T.serial(0, sg) as gi:
                acc = unit_sums(j * sg + gi, 0)
                mults = [T.bind(self.param(self.SF, j * sg + gi, r, "int32")) for r in range(r_)]
                for c in range(c_):
                    for r in range(r_):
                        total = sums[at(c, r)]
                        for piece in acc:
                            total = total + self.isa.dot_scaled(piece[r * c_ + c], mults[r])
                        T.buffer_store(sums, total, [at(c, r)])
            # the Σx term over the super group's groups, as expressions (registers)
            term = self.sum_term
            terms = [self.bcast(f32(0.0))] * (r_ * c_)
            for gi in range(sg if term else 0):
                g = j * sg + gi
                coefs = [T.bind(self.param(self.SF if self.ZF is None else self.ZF, g, r)) for r in range(r_)]
                for c in range(c_):
                    xs = self.bcast(self.XS[n0 + c, g])
                    for r in range(r_):
                        terms[r * c_ + c] = T.bind(terms[r * c_ + c] + coefs[r] * xs)
            for r in range(r_):
                d = T.bind(self.super_param(self.SS, j, r))
                m = None if not term else T.bind(d * self.bcast(f32(self.offset)) if self.ZF is None
                                                 else self.super_param(self.ZS, j, r))
                for c in range(c_):
                    dx = self.bcast(self.XD[n0 + c, j])
                    total = d * (tirx.Cast(f"float32x{L}", sums[at(c, r)]) * dx)
                    total = total if m is None else total - m * terms[r * c_ + c]
                    T.buffer_store(F, F[at(c, r)] + total, [at(c, r)])

    def emit(self, name: str) -> None:
        from tvm import tirx
        from tvm.script.ir_builder import tirx as T

        parts = self.bm // self.rows
        with T.Assert(tirx.all(self.n <= self.np_, self.np_ % self.c == 0),
                      f"{name}: the activations must cover every output row in whole tiles of {self.c}", "ValueError"):
            with T.parallel(0, self.mb * parts) as task:
                self.blk, self.first = task // parts, task % parts * self.rows
                P = T.alloc_buffer((self.k // 4 * self.rows,), "uint32", scope="global")
                self.emit_unpack(P)
                with T.serial(0, self.np_ // self.c) as nt:
                    self.emit_tile(P, nt * self.c)


def dot_gemm_func(spec: KernelSpec, isa):
    gemm = _DotGemm(spec, isa)
    with prim_func("dot_gemm") as ib:
        gemm.declare()
        gemm.emit("dot_gemm")
    return ib.get()
