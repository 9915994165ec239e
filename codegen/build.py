"""Compile a ``KernelSpec`` for an ISA into a shared library (cross-linking for arm64 on an x86 host)."""

from __future__ import annotations

import shutil

from tmac.cpu import machine_arch
from tmac.glue import GlueSpec
from tmac.packing import KernelSpec

# the glue calls libm (expf); TVM puts options before the objects, where --as-needed would drop a plain -lm
LINK_LIBM = ["-Wl,--no-as-needed", "-lm"]
CROSS_LINKERS = {"arm64": ("aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu"),
                 "x86_64": ("x86_64-linux-gnu-gcc", "gcc-x86-64-linux-gnu")}


def linker_for(arch: str) -> str | None:
    """The C compiler that links a library for ``arch`` (None: the host's default)."""
    if arch == machine_arch():
        return None
    if arch not in CROSS_LINKERS:
        raise ValueError(f"unsupported target architecture {arch!r}; supported: {sorted(CROSS_LINKERS)}")
    cc, package = CROSS_LINKERS[arch]
    if shutil.which(cc) is None:
        raise RuntimeError(f"cross-compiling for {arch} needs {cc}: install the Debian package {package} "
                           f"(apt-get install {package})")
    return cc


def compile_kernel(spec: KernelSpec | GlueSpec, isa):
    """The compiled (not yet exported) TVM executable of ``spec`` (LUT kernels or decode glue) for ``isa``."""
    import tvm

    from . import glue, lut

    if spec.isa != isa.name or spec.vector_bytes != isa.vector_bytes:
        raise ValueError(f"kernel spec {spec.name} is not for ISA {isa.name}")
    generator = glue if isinstance(spec, GlueSpec) else lut
    return tvm.compile(generator.module(spec, isa), target=isa.target)


def build_library(spec: KernelSpec, isa, path: str) -> None:
    """Write the shared library of ``spec`` to ``path``."""
    cc = linker_for(isa.arch)
    executable = compile_kernel(spec, isa)
    if cc is None:
        executable.export_library(path, options=LINK_LIBM)
    else:
        executable.export_library(path, cc=cc, options=LINK_LIBM)
