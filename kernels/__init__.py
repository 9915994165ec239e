"""Instruction sets the LUT kernels are generated for, one module per ISA family.

Each ``Isa`` says once what an instruction set is (LLVM target, vector width, the CPU features it needs) and
offers the same three primitives the code generator composes:

- ``lookup(table16, idx)``: 16-entry int8 table lookup, one table broadcast to every 16-byte lane (and, where
  ``wide_lookup``, ``lookup64``: one 64-entry table, four adjacent tables at once);
- ``accumulate(acc, looked, planes, period, first)``: add looked-up int8 values into wider accumulators, summing
  the ``planes`` adjacent bytes of a row with weights 1, 2, 4, 8 repeating every ``period`` bytes, times
  2^first (the dot-product trick);
- ``acc_dtype(planes, steps)``: the accumulator vector type that goes with it over a lut group of ``steps`` steps,
  and ``widen(acc, planes)``: a lut group's accumulator as int32 per row.

This package imports no TVM; the primitives import it when they are called, i.e. only while compiling.
"""

from __future__ import annotations

import os

from tmac.base.cpu import cpu_features, machine_arch, normalize_arch
from tmac.base.errors import KernelUnavailableError
from tmac.kernels.base import Isa
from tmac.kernels.arm import NEON, NEON_DOTPROD
from tmac.kernels.generic import GENERIC_ARM64, GENERIC_X86
from tmac.kernels.x86 import AVX2, AVX2_VNNI, AVX512, AVX512_VBMI, AVX512_VNNI

# best first within an architecture
ISAS: dict[str, Isa] = {i.name: i for i in (AVX512_VBMI, AVX512_VNNI, AVX512, AVX2_VNNI, AVX2, GENERIC_X86,
                                            NEON_DOTPROD, NEON, GENERIC_ARM64)}

# what kernels for another architecture target when no ISA is named: a Raspberry Pi 5 (Cortex-A76) has dotprod;
# AVX2 runs on every x86-64 CPU of the last decade
DEFAULT_ISA = {"arm64": "neon_dotprod", "x86_64": "avx2"}


def isa_by_name(name: str, arch: str | None = None) -> Isa:
    """The ISA named ``name`` as ``tmac info`` prints it (``-`` for ``_`` accepted); ``generic``: ``arch``'s."""
    key = name.strip().lower().replace("-", "_")
    if key == "generic":
        key = {i.arch: n for n, i in ISAS.items() if n.startswith("generic")}[arch or machine_arch()]
    try:
        return ISAS[key]
    except KeyError:
        raise ValueError(f"unknown ISA {name!r}; known: {', '.join(ISAS)}, generic") from None


ISA_ENV = "TMAC_ISA"  # names the ISA this machine's kernels use instead of the best it can run


def best_isa(arch: str | None = None, features: frozenset[str] | None = None) -> Isa:
    """The fastest ISA variant the given (default: this) machine can run; for this machine, the one ``TMAC_ISA``
    names if it is set (to compare ISAs, or to test an older CPU's kernels on a newer one)."""
    if (arch is None or arch == machine_arch()) and features is None and os.environ.get(ISA_ENV, "").strip():
        return chosen_isa(os.environ[ISA_ENV])
    arch = arch or machine_arch()
    features = cpu_features() if features is None else features
    for isa in ISAS.values():
        if isa.arch == arch and isa.features <= features:
            return isa
    raise ValueError(f"unsupported CPU architecture {arch!r}; supported: x86_64, arm64")


def target_isa(arch: str | None, isa_name: str | None) -> Isa:
    """The ISA ``tmac compile`` and ``tmac convert`` target for ``--arch``/``--isa``: named, else this CPU's best,
    else ``arch``'s common one (``DEFAULT_ISA``)."""
    if arch:
        arch = normalize_arch(arch)
    else:  # the named ISA's, else this machine's
        arch = isa_by_name(isa_name).arch if isa_name and isa_name != "generic" else machine_arch()
    if isa_name is None:
        return best_isa() if arch == machine_arch() else isa_by_name(DEFAULT_ISA[arch])
    isa = isa_by_name(isa_name, arch)
    if isa.arch != arch:
        raise ValueError(f"--isa {isa.name} is for {isa.arch}, not --arch {arch}")
    return isa


def isas_for(arch: str) -> list[Isa]:
    return [i for i in ISAS.values() if i.arch == arch]


def lacking(isa: Isa) -> list[str]:
    """What this machine lacks to execute ``isa``'s code (running it anyway would die by SIGILL): nothing where it
    can, else the missing features, or the other architecture."""
    if isa.arch != machine_arch():
        return [f"arch {isa.arch}"]
    return sorted(isa.features - cpu_features())


def check_runnable(isa: Isa) -> None:
    """Raise unless this machine can execute ``isa``'s code."""
    missing = lacking(isa)
    if missing:
        raise KernelUnavailableError(f"kernels for ISA {isa.name} cannot run on this {machine_arch()} CPU (lacks: "
                                     f"{', '.join(missing)}); repack the weights for {best_isa().name}")


def chosen_isa(name: str) -> Isa:
    """The ISA ``TMAC_ISA`` names, checked to be one this machine can execute."""
    try:
        isa = isa_by_name(name)
    except ValueError as e:
        raise ValueError(f"{ISA_ENV}={name!r}: {e}") from None
    missing = lacking(isa)
    if missing:
        runnable = [i.name for i in isas_for(machine_arch()) if not lacking(i)]
        raise ValueError(f"{ISA_ENV}={name!r}: this CPU cannot execute {isa.name} (lacks {', '.join(missing)}); "
                         f"it can run: {', '.join(runnable)}")
    return isa
