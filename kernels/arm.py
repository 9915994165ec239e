"""arm64: NEON ``tbl`` does the lookups; with the dot-product extension ``sdot`` sums 4 bit planes of a row."""

from __future__ import annotations

from dataclasses import dataclass

from tmac.kernels.base import Isa, plane_weights


@dataclass(frozen=True)
class ArmIsa(Isa):
    dotprod: bool = False

    def lookup(self, table16, idx):
        from tvm import tirx

        return tirx.call_llvm_pure_intrin("int8x16", "llvm.aarch64.neon.tbl1", table16, idx)

    def accumulate(self, acc, looked: list, planes: int, period: int, first: int):
        from tvm import tirx

        if planes == 4 and self.dotprod:
            w = plane_weights(16, period, "int8", first)
            for v in looked:
                acc = tirx.call_llvm_pure_intrin("int32x4", "llvm.aarch64.neon.sdot", acc, w, v)
            return acc
        return super().accumulate(acc, looked, planes, period, first)


def _target(mattr: list[str]) -> dict:
    return {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "generic", "mattr": mattr}


NEON_DOTPROD = ArmIsa("neon_dotprod", "arm64", 16, frozenset({"neon", "dotprod"}),
                      _target(["+neon", "+dotprod"]), "NEON + dotprod: tbl, sdot", dotprod=True)
NEON = ArmIsa("neon", "arm64", 16, frozenset({"neon"}), _target(["+neon"]), "NEON: tbl, widening adds")
