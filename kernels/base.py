"""What every ISA description has, and the portable forms of the primitives (plain TIR that LLVM vectorizes)."""

from __future__ import annotations

from dataclasses import dataclass, field


UNROLL_VECTORS = 32  # weight vectors an unrolled inner-loop body may load at most (docs/decisions.md, "Unroll")


@dataclass(frozen=True)
class Isa:
    name: str
    arch: str  # "x86_64" or "arm64"
    vector_bytes: int  # bytes in one lookup vector
    features: frozenset[str]  # tmac.base.cpu feature names a machine needs to run it
    target: dict = field(hash=False, compare=False)  # LLVM target, always with explicit triple and cpu/attrs
    description: str = ""
    wide_lookup: bool = False  # has ``lookup64`` (1- to 3-bit weights and triples then use quads)
    # ``lookup`` reads only the low 4 bits of each index (vpermb into 4 copies of the table): nibbles need no masks
    low_nibble_lookup: bool = False
    prefetch_bytes: int = 0  # a weight stream read once (GEMV, a few rows) is prefetched this far ahead (0: hardware only)
    prefetch_l2_bytes: int = 0  # and again this far ahead into L2 alone (0: not): more lines in flight from DRAM
    vector_registers: int = 32  # architectural vector registers: 16 on x86-64 before AVX-512 (SSE2, AVX2)
    # activation rows from which a 4-bit GEMM takes dot products on unpacked codes instead of table lookups
    # (codegen/dot.py; 0: never): measured, docs/decisions.md "Dot products for many rows"
    dot_rows: int = 0
    # the dot-product GEMM's register tile: (vectors of weight rows, activation rows), R·C accumulators; two
    # vectors by four rows on AVX-512 too, whose 32 registers would hold 4 x 4 but spilled the float sums beside them
    # (docs/decisions.md, "Dot products for many rows")
    dot_tile: tuple = (2, 4)
    # the dot-product GEMM loads an activation row's words of as many steps as a vector has lanes at once and takes
    # each step's by lane (arm64: ``sdot``'s indexed form), not as a broadcast load a step (``ld1r`` has no offset
    # addressing: each took an address computation besides)
    dot_lane_activations: bool = False
    # ``dot`` multiplies signed bytes (arm64's ``sdot``): codes of formats without zeros are unpacked less their
    # offset, and their epilogue has no offset term (x86's instructions take unsigned codes)
    dot_signed_codes: bool = False

    @property
    def dot_two_bit_super_groups(self) -> bool:
        """Whether 2-bit codes in K-quant super groups of 32-weight groups (IQ1_S) take dot products for many rows:
        their multipliers sum in integers once a group, where two planes' lookups cost a float epilogue a group."""
        return False

    @property
    def dot_codebooks(self) -> bool:
        """Whether ``dot`` can multiply a codebook's levels (i-quants: int8 levels up to ±127, or those + 128 as
        unsigned bytes), not only small codes."""
        return False

    def dot_tile_of(self, spec) -> tuple:
        """The dot-product GEMM's register tile for ``spec``'s kernel (``dot_tile`` unless the ISA says otherwise)."""
        return self.dot_tile

    @property
    def dot_signed_levels(self) -> bool:
        """Whether ``dot`` takes a codebook's levels as signed bytes (``dot``'s ``signed``), not the levels + 128 as
        unsigned ones: where unsigned ones would saturate (AVX2's ``vpmaddubsw``)."""
        return False

    @property
    def expands_grids(self) -> bool:
        """Whether the kernels expand grid i-quants' indices and sign bits into codes in registers (``permute2``,
        ``multishift``: ``tmac.codegen.grids``), so that they are held at their own size."""
        return False

    @property
    def gemm_accumulators(self) -> int:
        """Accumulator vectors a GEMM tile keeps before a block's rows are done in parts: a quarter of the
        registers."""
        return self.vector_registers // 4

    @property
    def sum_vectors(self) -> int:
        """Running sums a float loop may keep in vector registers: half of them; more spill to the stack on every
        iteration."""
        return self.vector_registers // 2

    def unroll_fits(self, vectors: list[tuple[int, float]]) -> bool:
        """Whether an unrolled inner-loop body may load these weight vectors, (planes of a chunk, its vectors) each
        (tmac.quant.choose): ``UNROLL_VECTORS`` in all."""
        return sum(v for _, v in vectors) <= UNROLL_VECTORS

    def acc_dtype(self, planes: int, steps: int) -> str:
        """The accumulator vector type of ``accumulate`` over a lut group of ``steps`` steps."""
        lanes = self.vector_bytes // planes
        return f"int32x{lanes}" if planes == 4 else f"int16x{lanes}"

    def widen(self, acc, planes: int):
        """int32 per row (lanes in ``acc_rows`` order) of a lut group's accumulator."""
        from tvm import tirx

        return tirx.Cast(f"int32x{self.vector_bytes // planes}", acc)

    def acc_rows(self, planes: int) -> list[int] | None:
        """The row each lane of ``accumulate``'s result holds, when not lane = row (None)."""
        return None

    def dot_acc_dtype(self, bits: int, quads: int, largest: int | None = None) -> str:
        """The accumulator type of ``dot`` over ``quads`` 4-activation steps of ``bits``-bit codes (or of weight
        bytes up to ``largest`` in magnitude: a codebook's levels)."""
        return f"int32x{self.vector_bytes // 4}"

    def dot(self, acc, w, x, signed: bool = False):
        """``acc`` plus, per 32-bit lane, the dot product of its four code bytes ``w`` (unsigned, as int8xVL; signed
        with ``signed``: codes less their offset, a codebook's levels) with the four int8 activations ``x``. Portable
        form: widened products."""
        from tvm import tirx

        lanes = self.vector_bytes // 4
        codes = w if signed else tirx.reinterpret(f"uint8x{self.vector_bytes}", w)
        for j in range(4):
            pick = list(range(j, self.vector_bytes, 4))
            acc = acc + tirx.Cast(f"int32x{lanes}", tirx.Shuffle([codes], pick)) * \
                tirx.Cast(f"int32x{lanes}", tirx.Shuffle([x], pick))
        return acc

    def dot_widen(self, acc):
        """``dot``'s accumulator as int32 per lane."""
        return acc

    def dot_scaled(self, acc, mult):
        """``dot``'s accumulator as int32 per lane times ``mult`` (int32 per lane: a K-quant group's multiplier)."""
        return self.dot_widen(acc) * mult

    # -- primitives; subclasses override them with instructions ---------------------------------------------
    def lookup(self, table16, idx):
        """int8xVL: ``table16[idx[l]]`` in every lane (idx values are 0..15). Portable form: a select chain."""
        from tvm import tirx

        lanes = self.vector_bytes
        out = tirx.Shuffle([table16], [0] * lanes)
        for p in range(1, 16):
            hit = idx == tirx.Broadcast(tirx.IntImm("int8", p), lanes)
            out = tirx.Select(hit, tirx.Shuffle([table16], [p] * lanes), out)
        return out

    def lookup64(self, table64, idx):
        """int8xVL: ``table64[idx[l] % 64]`` in every lane, on ISAs with ``wide_lookup``."""
        raise NotImplementedError(f"ISA {self.name} has no 64-entry table lookup")

    def lane_mask(self, mask_bytes):
        """boolxVL: lane l is bit l of the little-endian bit mask ``mask_bytes`` (uint8 x VL/8). Portable form:
        each byte spread over its 8 lanes and tested against the lane's bit."""
        from tvm import tirx

        lanes = self.vector_bytes
        # (a shuffle may not have more lanes than its inputs: eight copies of the VL/8 bytes)
        spread = tirx.Shuffle([mask_bytes] * 8, [lane // 8 for lane in range(lanes)])
        return (spread & plane_weights(lanes, 8, "uint8")) != tirx.Broadcast(tirx.IntImm("uint8", 0), lanes)

    def accumulate(self, acc, looked: list, planes: int, period: int, first: int):
        """``acc`` plus, per row, Σ over ``looked`` of Σ_j 2^(first + j mod period)·byte(row, j) — rows own
        ``planes`` adjacent bytes, bit planes repeating every ``period`` bytes (``planes`` for bit-plane chunks;
        quads: the chunk's 1 or 2 planes, the bytes of several tables, from plane ``first``). Portable form: widen
        every byte and add them shifted."""
        from tvm import tirx

        lanes = self.vector_bytes // planes
        wide = "int32" if planes == 4 else "int16"
        for v in looked:
            for j in range(planes):
                part = tirx.Cast(f"{wide}x{lanes}", tirx.Shuffle([v], list(range(j, self.vector_bytes, planes))))
                shift = first + j % period
                acc = acc + (part << tirx.Broadcast(tirx.IntImm(wide, shift), lanes) if shift else part)
        return acc


def broadcast_table(table16, lanes: int):
    """A 16-byte table repeated into every 16-byte lane of a ``lanes``-byte vector."""
    from tvm import tirx

    return table16 if lanes == 16 else tirx.Shuffle([table16] * (lanes // 16), list(range(lanes)))


def plane_weights(lanes: int, period: int, dtype: str, first: int = 0):
    """The constant vector 2^first · (1, 2, 4, 8 ...: its first ``period`` values) repeated over ``lanes`` bytes."""
    from tvm import tirx

    ramp = tirx.Ramp(tirx.IntImm("int32", 0), tirx.IntImm("int32", 1), lanes)
    one = tirx.Broadcast(tirx.IntImm("int32", 1), lanes)
    shifts = ramp % tirx.Broadcast(tirx.IntImm("int32", period), lanes) + tirx.Broadcast(tirx.IntImm("int32", first),
                                                                                             lanes)
    return tirx.Cast(f"{dtype}x{lanes}", one << shifts)
