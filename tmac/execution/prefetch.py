"""Kernels compiled ahead, in a child process, while a model loads.

Kernels used to compile on first use: after the load, one after another, in the run's own process (TVM's compiler
imported into it, a few hundred MiB at the peak). The loader now names each kernel as soon as it knows it — a
layer's projections once the first layer is packed, the decode glue once the token table is made — and a child
process compiles those the cache lacks into the cache, each under the per-kernel lock a run's own compile takes.
The load goes on meanwhile; the first forward finds them cached, waits on the lock of the one being compiled, or
compiles one the child has not reached yet itself (then the child finds it cached and goes on).

The children are ``python -m tmac.execution.compile_ahead`` (one kernel spec as JSON a line on its standard input), one
a CPU this process may use, up to ``MAX_CHILDREN``, started as kernels are named and given them in turn: the compiler
holds its process's GIL for much of its work, so kernels compile side by side only in processes of their own.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import time

from tmac.base.glue import GlueSpec

_RUNNING: list["CompileAhead"] = []  # this process's children, for ``wait_for``
MAX_CHILDREN = 4  # (each imports TVM's compiler: a few hundred MiB)


def wait_for(name: str) -> None:
    """Where a child was given kernel ``name``, wait until it is cached or the child has stopped: the run's process
    then loads it instead of compiling it again (and never imports the compiler)."""
    from tmac.quant.cache import cache_dir

    for ahead in _RUNNING:
        child = ahead.given.get(name)
        if child is None:
            continue
        so, meta = os.path.join(cache_dir(), name + ".so"), os.path.join(cache_dir(), name + ".json")
        while child.poll() is None and not (os.path.exists(so) and os.path.exists(meta)):
            time.sleep(0.02)


class CompileAhead:
    """The child processes, started as the kernels the cache lacks are named; ``close`` says there are no more."""

    def __init__(self, kernel_dir: str | None = None, held: bool = False):
        """``held``: the run goes on with its token table as a packed copy holds it, whose lookup another glue
        kernel does."""
        from tmac.base.cpu import usable_cpus

        self.enabled = not (kernel_dir or os.environ.get("TMAC_KERNEL_DIR"))  # (a directory has them, or not)
        self.held = held
        self.most = max(1, min(MAX_CHILDREN, usable_cpus()))
        self.children: list[subprocess.Popen] = []
        self.named: set[str] = set()
        self.given: dict[str, subprocess.Popen] = {}  # kernel name → the child compiling it

    def want(self, spec) -> None:
        """Compile ``spec`` (a ``KernelSpec`` or ``GlueSpec``) ahead if the cache lacks it."""
        if not self.enabled or spec.name in self.named:
            return
        self.named.add(spec.name)
        from tmac.quant.cache import cache_dir, cached_library
        from tmac.kernels import isa_by_name

        if cached_library(cache_dir(), spec, isa_by_name(spec.isa)):
            return
        try:
            turn = len(self.given) % self.most
            if turn == len(self.children):
                child = subprocess.Popen([sys.executable, "-m", "tmac.execution.compile_ahead"], stdin=subprocess.PIPE,
                                         text=True)
                atexit.register(_stop, child)
                self.children.append(child)
                if self not in _RUNNING:
                    _RUNNING.append(self)
            child = self.children[turn]
            kind = "glue" if isinstance(spec, GlueSpec) else "lut"
            child.stdin.write(json.dumps({"kind": kind, "spec": _fields(spec)}) + "\n")
            child.stdin.flush()
            self.given[spec.name] = child
        except OSError:  # no child (no processes left, a closed pipe): the kernels compile on first use
            self.enabled = False

    def close(self) -> None:
        for child in self.children:
            if not child.stdin.closed:
                try:
                    child.stdin.close()
                except OSError:
                    pass


def _fields(spec) -> dict:
    from tmac.quant.cache import spec_record

    return spec_record(spec)


def _stop(child: subprocess.Popen) -> None:
    """At the run's exit: a child still compiling is stopped (a kernel is written whole or not at all)."""
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(5)
        except subprocess.TimeoutExpired:
            child.kill()
