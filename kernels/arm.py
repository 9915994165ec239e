"""arm64: NEON ``tbl`` does the lookups; with the dot-product extension ``sdot`` sums 4 bit planes of a row, and
``smlal`` weights the bytes of the others (2 planes; 4 planes without dotprod) in int16, summed per row
(``saddlp``, ``addp``) once a lut group."""

from __future__ import annotations

from dataclasses import dataclass

from tmac.kernels.base import Isa, plane_weights

# largest |table entry| (tables are int8 in ±127: tmac.base.reference.quantize_tables)
TABLE_MAX = 127


@dataclass(frozen=True)
class ArmIsa(Isa):
    dotprod: bool = False

    def lookup(self, table16, idx):
        from tvm import tirx

        return tirx.call_llvm_pure_intrin("int8x16", "llvm.aarch64.neon.tbl1", table16, idx)

    def _byte_sums(self, planes: int, steps: int) -> bool:
        """Whether a lut group of ``steps`` steps sums ``planes``-plane rows as weighted bytes in int16 lanes (one
        ``smlal`` per 8 bytes, where widening and shifting every byte took four or five instructions a lookup, and
        twenty-odd for 4 planes without dotprod): 2 lookups a step, each byte at most 127 times its plane's weight,
        must fit int16."""
        if planes not in (2, 4) or planes == 4 and self.dotprod:
            return False
        return steps * 2 * TABLE_MAX * (1 << (planes - 1)) < 1 << 15

    def acc_dtype(self, planes: int, steps: int) -> str:
        if self._byte_sums(planes, steps):
            return f"int16x{self.vector_bytes}"  # a lane a byte: (row, plane)
        return super().acc_dtype(planes, steps)

    def accumulate(self, acc, looked: list, planes: int, period: int, first: int):
        from tvm import tirx

        if planes == 4 and self.dotprod:
            w = plane_weights(16, period, "int8", first)
            for v in looked:
                acc = tirx.call_llvm_pure_intrin("int32x4", "llvm.aarch64.neon.sdot", acc, w, v)
            return acc
        if _in_byte_lanes(acc, self.vector_bytes) and planes > 1:
            if first or period != planes:  # (bit-plane chunks only: the bound above assumed weights 1 .. 2^(p-1))
                raise ValueError(f"{self.name}: byte sums of {planes} planes from plane {first}, period {period}")
            w = _halves(plane_weights(16, period, "int8", first))
            for v in looked:
                products = [tirx.call_llvm_pure_intrin("int16x8", "llvm.aarch64.neon.smull", h, wh)
                            for h, wh in zip(_halves(v), w)]
                acc = acc + tirx.Shuffle(products, list(range(16)))  # smlal, smlal2
            return acc
        return super().accumulate(acc, looked, planes, period, first)

    def widen(self, acc, planes: int):
        from tvm import tirx

        if not (_in_byte_lanes(acc, self.vector_bytes) and planes > 1):
            return super().widen(acc, planes)
        pairs = [tirx.call_llvm_pure_intrin("int32x4", "llvm.aarch64.neon.saddlp", h) for h in _halves(acc)]
        if planes == 2:  # a row's two bytes: one pair
            return tirx.Shuffle(pairs, list(range(8)))
        return tirx.call_llvm_pure_intrin("int32x4", "llvm.aarch64.neon.addp", *pairs)  # its four: two pairs


def _in_byte_lanes(acc, vector_bytes: int) -> bool:
    """Whether ``acc`` is ``acc_dtype``'s int16 lane a byte (``ArmIsa._byte_sums``)."""
    return str(acc.ty) == f"int16x{vector_bytes}"


def _halves(v):
    """The low and high 8 lanes of a 16-lane vector."""
    from tvm import tirx

    return [tirx.Shuffle([v], list(range(h, h + 8))) for h in (0, 8)]


def _target(mattr: list[str]) -> dict:
    return {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "generic", "mattr": mattr}


NEON_DOTPROD = ArmIsa("neon_dotprod", "arm64", 16, frozenset({"neon", "dotprod"}),
                      _target(["+neon", "+dotprod"]), "NEON + dotprod: tbl, sdot, smlal", dotprod=True)
NEON = ArmIsa("neon", "arm64", 16, frozenset({"neon"}), _target(["+neon"]), "NEON: tbl, smlal, saddlp")
