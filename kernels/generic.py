"""The fallback for CPUs without a usable table-lookup instruction: the portable primitives of ``Isa``,
vectorized by LLVM for the baseline of the architecture. ``tmac info`` flags it."""

from tmac.kernels.base import Isa

GENERIC_X86 = Isa("generic_x86_64", "x86_64", 16, frozenset(),
                  {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "x86-64"},
                  "fallback: SSE2 selects, no pshufb", vector_registers=16)
GENERIC_ARM64 = Isa("generic_arm64", "arm64", 16, frozenset(),
                    {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "generic"},
                    "fallback: plain NEON selects, no tbl")
