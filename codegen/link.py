"""Which C compiler driver links a kernel's object code into a shared library, for the host or another arch.

TVM emits the object code itself (its LLVM knows every target); only the final link needs a driver. In order:
``$TMAC_CC`` (a command, used as given), a system compiler (``cc``/``gcc``/``clang`` natively, Debian's
``<triple>-gcc`` across architectures), then the ``ziglang`` wheel (``zig cc -target <triple>``: links for any
target without a sysroot, so ``pip`` alone is enough). A system compiler goes first because zig builds its runtime
library for each target on its first link (about 25 s, then cached), and installs 400 MB where gcc is usually there.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass

from tmac.base.cpu import machine_arch
from tmac.base.errors import KernelUnavailableError

TRIPLES = {"arm64": "aarch64-linux-gnu", "x86_64": "x86_64-linux-gnu"}
NATIVE_COMPILERS = ("cc", "gcc", "clang")
CROSS_PACKAGES = {"arm64": "gcc-aarch64-linux-gnu", "x86_64": "gcc-x86-64-linux-gnu"}
# the glue calls libm (expf); TVM puts options before the objects, where --as-needed would drop a plain -lm
LINK_OPTIONS = ["-Wl,--no-as-needed", "-lm"]


class LinkerUnavailableError(KernelUnavailableError):
    """No way to link kernels for the requested architecture on this machine."""


@dataclass(frozen=True)
class Linker:
    command: tuple[str, ...]  # the driver and the arguments every link starts with
    arch: str

    @property
    def name(self) -> str:
        return "zig cc" if "ziglang" in self.command else os.path.basename(self.command[0])

    def fcompile(self):
        """A TVM ``export_library`` link function calling this driver."""
        def link(output: str, objects, options=None, **_):
            objects = [objects] if isinstance(objects, str) else list(objects)
            cmd = [*self.command, "-shared", "-fPIC", "-o", output, *objects, *(options or [])]
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if r.returncode != 0:
                hint = " (TMAC_CC chose it: check that command)" if os.environ.get("TMAC_CC") else ""
                raise LinkerUnavailableError(
                    f"linking kernel {os.path.basename(output)} for {self.arch} with {self.name} failed{hint} "
                    f"(exit {r.returncode}): {r.stdout.strip()[-2000:] or 'no output'}; command: {shlex.join(cmd)}")
        link.output_format = "so"
        return link


def find_linker(arch: str, path: str | None = None) -> Linker:
    """The linker for ``arch`` kernels on this machine; raises ``LinkerUnavailableError`` saying how to get one."""
    if arch not in TRIPLES:
        raise ValueError(f"unsupported target architecture {arch!r}; supported: {', '.join(TRIPLES)}")
    override = os.environ.get("TMAC_CC")
    if override:
        command = shlex.split(override)
        if not command or shutil.which(command[0], path=path) is None:
            raise LinkerUnavailableError(f"TMAC_CC={override!r}: {command[0] if command else '(empty)'} not found")
        return Linker(tuple(command), arch)
    triple = TRIPLES[arch]
    candidates = NATIVE_COMPILERS if arch == machine_arch() else (f"{triple}-gcc",)
    for cc in candidates:
        found = shutil.which(cc, path=path)
        if found:
            return Linker((found,), arch)
    if importlib.util.find_spec("ziglang") is not None:
        return Linker((sys.executable, "-m", "ziglang", "cc", "-target", triple), arch)
    system = "a C compiler (cc, gcc or clang)" if arch == machine_arch() else \
        f"{triple}-gcc (Debian: apt-get install {CROSS_PACKAGES[arch]})"
    raise LinkerUnavailableError(f"linking kernels for {arch} needs a C linker and none was found: "
                                 f"pip install ziglang (or: pip install 'tmac[link]'), or install {system}")
