"""Compile a ``KernelSpec`` for an ISA into a shared library (linked by ``link.find_linker``)."""

from __future__ import annotations

from tmac.base.glue import GlueSpec
from tmac.quant.spec import KernelSpec

from tmac.codegen.link import LINK_OPTIONS, find_linker


def compile_kernel(spec: KernelSpec | GlueSpec, isa):
    """The compiled (not yet exported) TVM executable of ``spec`` (LUT kernels or decode glue) for ``isa``."""
    import tvm

    from tmac.codegen import glue, lut

    if spec.isa != isa.name:
        raise ValueError(f"kernel spec {spec.name} is not for ISA {isa.name}")
    generator = glue if isinstance(spec, GlueSpec) else lut
    return tvm.compile(generator.module(spec, isa), target=isa.target)


def build_library(spec: KernelSpec, isa, path: str) -> None:
    """Write the shared library of ``spec`` to ``path``."""
    linker = find_linker(isa.arch)  # before compiling: a missing linker fails at once
    compile_kernel(spec, isa).export_library(path, fcompile=linker.fcompile(), options=LINK_OPTIONS)
