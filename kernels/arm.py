"""arm64: NEON ``tbl`` does the lookups; with the dot-product extension ``sdot`` sums 4 bit planes of a row, and
``sadalp`` + ``ssra`` the others' byte pairs (2 planes; 4 planes without dotprod) in int16. With dotprod a prompt's
rows multiply instead (``sdot`` on unpacked codes, codegen/dot.py)."""

from __future__ import annotations

from dataclasses import dataclass

from tmac.kernels.base import Isa, plane_weights

# largest |table entry| (tables are int8 in ±127: tmac.base.reference.quantize_tables)
TABLE_MAX = 127
PAIR_SUM_VECTORS = 12  # weight vectors of pair-summed chunks an unrolled body may load (``unroll_fits``)


@dataclass(frozen=True)
class ArmIsa(Isa):
    dotprod: bool = False

    def lookup(self, table16, idx):
        from tvm import tirx

        return tirx.call_llvm_pure_intrin("int8x16", "llvm.aarch64.neon.tbl1", table16, idx)

    @property
    def dot_codebooks(self) -> bool:
        return self.dotprod  # ``sdot``: the levels as signed bytes

    def dot(self, acc, w, x, signed: bool = False):
        if not self.dotprod:
            return super().dot(acc, w, x, signed)
        from tvm import tirx

        # codes of at most 6 bits (``DOT_BITS``), or less their offset (``dot_signed_codes``): ``sdot``'s int8 × int8
        return tirx.call_llvm_pure_intrin("int32x4", "llvm.aarch64.neon.sdot", acc,
                                          tirx.reinterpret("int8x16", w), tirx.reinterpret("int8x16", x))

    def _pair_sums(self, planes: int, steps: int) -> bool:
        """Whether a lut group of ``steps`` steps sums ``planes``-plane rows as byte pairs in int16 lanes: 2 planes,
        and 4 without dotprod. A 16-bit lane holds a row's bytes b0, b1 (planes 2j, 2j+1), and ``sadalp`` adds
        b0 + b1 to it, ``ssra`` its high byte once more (the lane shifted right by 8 is b1, whatever b0's sign): b0 +
        2·b1 in two instructions a lookup, where widening and shifting every byte took four or five (twenty-odd
        for 4 planes, each byte widened to int32). 2 lookups a step, at most 3·127 each, must fit int16."""
        if planes not in (2, 4) or planes == 4 and self.dotprod:
            return False
        return steps * 2 * 3 * TABLE_MAX < 1 << 15

    @property
    def _pair_type(self) -> str:
        """The pair sums' accumulator: an int16 lane a row's byte pair."""
        return f"int16x{self.vector_bytes // 2}"

    def unroll_fits(self, vectors: list[tuple[int, float]]) -> bool:
        # only the pair-summed chunks' vectors count: counting a step's every vector against 8 left 6-bit steps
        # never unrolled (a tenth more instructions a Q6_K GEMV); 16 pair-summed vectors (8-bit) lost, and the 5-bit
        # types without dotprod lose up to 4 % at 8 (counted under qemu: docs/decisions.md, "NEON's tilings by
        # instruction counts")
        paired = sum(v for planes, v in vectors if self._pair_sums(planes, 1))
        return paired <= PAIR_SUM_VECTORS and super().unroll_fits(vectors)

    def acc_dtype(self, planes: int, steps: int) -> str:
        if self._pair_sums(planes, steps):
            return self._pair_type  # a lane a byte pair: (row, planes 2j and 2j + 1)
        return super().acc_dtype(planes, steps)

    def accumulate(self, acc, looked: list, planes: int, period: int, first: int):
        from tvm import tirx

        if planes == 4 and self.dotprod:
            w = plane_weights(16, period, "int8", first)
            for v in looked:
                acc = tirx.call_llvm_pure_intrin("int32x4", "llvm.aarch64.neon.sdot", acc, w, v)
            return acc
        if self._pair_sums(planes, 1) and str(acc.ty) == self._pair_type:
            if first or period != planes:  # (bit-plane chunks: weights 1 .. 2^(p−1) from plane 0)
                raise ValueError(f"{self.name}: pair sums of {planes} planes from plane {first}, period {period}")
            eight = tirx.Broadcast(tirx.IntImm("int16", 8), self.vector_bytes // 2)
            for v in looked:
                acc = acc + tirx.call_llvm_pure_intrin(self._pair_type, "llvm.aarch64.neon.saddlp", v)
                acc = acc + (tirx.reinterpret(self._pair_type, v) >> eight)  # ssra
            return acc
        return super().accumulate(acc, looked, planes, period, first)

    def widen(self, acc, planes: int):
        from tvm import tirx

        if planes == 4 and str(acc.ty) == self._pair_type:  # a row's two pairs: b0 + 2b1, b2 + 2b3
            rows = self.vector_bytes // 4
            low, high = (tirx.Cast(f"int32x{rows}", tirx.Shuffle([acc], list(range(j, 2 * rows, 2)))) for j in (0, 1))
            return low + (high << tirx.Broadcast(tirx.IntImm("int32", 2), rows))
        return super().widen(acc, planes)


def _target(mattr: list[str]) -> dict:
    return {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "generic", "mattr": mattr}


NEON_DOTPROD = ArmIsa("neon_dotprod", "arm64", 16, frozenset({"neon", "dotprod"}),
                      _target(["+neon", "+dotprod"]), "NEON + dotprod: tbl, sdot, sadalp", dotprod=True,
                      dot_rows=16, dot_lane_activations=True, dot_signed_codes=True)
NEON = ArmIsa("neon", "arm64", 16, frozenset({"neon"}), _target(["+neon"]), "NEON: tbl, sadalp, ssra")
