"""Loading compiled kernels (from a kernel directory, the cache, or compiled now) and the threads they run on.

Kernels are shared libraries loaded with ``tvm_ffi`` after preloading ``libtvm_runtime.so`` (which fills the
thread-pool and workspace hooks the libraries call), so running with cached kernels never imports ``tvm``;
only a cache miss imports ``tmac.codegen`` (and with it TVM) to compile.

Cache (``tmac.quant.cache``): ``$TMAC_CACHE_DIR`` or ``~/.cache/tmac``, one subdirectory per TVM version and kernel
generator version, one ``<spec>.so`` plus a ``<spec>.json`` sidecar (spec, ISA, TVM version, sha256) per kernel. Writes go to a temporary file and are
renamed into place under a file lock, so concurrent processes never load a half-written library; a library
whose hash does not match its sidecar is rebuilt, never loaded. ``$TMAC_KERNEL_DIR`` (or an explicit
directory) with a ``manifest.json`` written by ``tmac compile`` is looked in first.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import sys
import threading
import time
import warnings

from tmac.quant.cache import (MANIFEST, atomic_write_text, cache_dir, cached_library, check_entry, generator_digest,
                    kernel_entry, lock_file, read_manifest, sha256, unsafe_dir_reason, warned_dirs, writable_cache)
from tmac.base.cpu import physical_cores, usable_cpus
from tmac.base.files import check_room, write_atomically
from tmac.base.errors import KernelUnavailableError
from tmac.quant.spec import KernelSpec

_lock = threading.Lock()
_loaded: dict[tuple[str, str | None], "KernelLibrary"] = {}
_num_threads = 0
_local = threading.local()


# ---- threads ------------------------------------------------------------------------------------------------

def _default_threads() -> int:
    env = os.environ.get("TMAC_NUM_THREADS")
    if env:
        return clamp_threads(env_int("TMAC_NUM_THREADS", 1, 1 << 30), "TMAC_NUM_THREADS")
    return min(physical_cores(), usable_cpus())


def env_int(name: str, low: int, high: int) -> int:
    """The integer environment variable ``name``, which must lie in [low, high]; ``ValueError`` naming it otherwise."""
    text = os.environ.get(name, "")
    try:
        value = int(text.strip())
    except ValueError:
        raise ValueError(f"{name} must be an integer from {low} to {high}, got {text[:40]!r}") from None
    if not low <= value <= high:
        raise ValueError(f"{name} must be an integer from {low} to {high}, got {text[:40]!r}")
    return value


ON_POOL = ", on the pool"  # marks the kinds of call a profile lists that run on the kernels' thread pool


def clamp_threads(n: int, what: str) -> int:
    """``n`` threads, or the CPUs this process may use where it asks for more (each thread would only wait for a
    CPU, and thousands exhaust the machine's process IDs), with a warning naming ``what``."""
    most = usable_cpus()
    if n > most:
        warnings.warn(f"{what}={n}: this process may use {most} CPU{'s' if most > 1 else ''}; using {most} threads",
                      stacklevel=3)
        return most
    return n


def set_num_threads(n: int) -> None:
    """Threads the kernels use (default: ``$TMAC_NUM_THREADS`` or the number of physical cores), at most the CPUs
    this process may use."""
    global _num_threads
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"number of threads must be a positive int, got {n!r}")
    _num_threads = clamp_threads(n, "threads")


def get_num_threads() -> int:
    global _num_threads
    if not _num_threads:
        _num_threads = _default_threads()
    return _num_threads


def apply_threads() -> None:
    """TVM's pool is per calling thread and sized when first used: configure this thread's pool if needed."""
    n = get_num_threads()
    if getattr(_local, "threads", None) != n:
        ffi().get_global_func("runtime.config_threadpool")(1, n)  # 1 = kBig: the fastest cores
        _local.threads = n


# ---- loading --------------------------------------------------------------------------------------------------

def tvm_runtime_library() -> str:
    spec = importlib.util.find_spec("tvm")
    if spec is None or not spec.submodule_search_locations:
        raise KernelUnavailableError("apache-tvm is not installed (it provides libtvm_runtime.so)")
    path = os.path.join(spec.submodule_search_locations[0], "lib", "libtvm_runtime.so")
    if not os.path.exists(path):
        raise KernelUnavailableError(f"libtvm_runtime.so not found at {path}")
    return path


_ffi_module = None
SPIN_YIELDS = 4000  # TVM_THREAD_POOL_SPIN_COUNT unless set: a few ms of sched_yield
KERNEL_ROOM = 32 << 20  # bytes a kernel's compile may write at most (its objects and library: well under a MiB)
MAX_SPIN_YIELDS = 10_000_000  # a user's setting past this (seconds of spinning per wait) is refused


def ffi():
    """The ``tvm_ffi`` module, with ``libtvm_runtime.so`` preloaded (compiled kernels need its hooks)."""
    global _ffi_module
    if _ffi_module is None:
        # the pool is created with TVM_NUM_THREADS workers (TVM's default is half the cores); allow all of them,
        # set_num_threads() then narrows per call site
        if os.environ.get("TVM_NUM_THREADS"):  # TVM aborts the process on a count it cannot start
            os.environ["TVM_NUM_THREADS"] = str(clamp_threads(env_int("TVM_NUM_THREADS", 1, 1 << 30),
                                                              "TVM_NUM_THREADS"))
        os.environ.setdefault("TVM_NUM_THREADS", str(usable_cpus()))
        # idle workers spin (sched_yield) a few ms before sleeping: waking a sleeping worker costs as much as a small
        # GEMV, while the gaps between a decode step's kernel calls are µs; TVM's own default spins far longer, too
        # long beside torch ops sharing the cores (docs/decisions.md, "TVM's idle workers")
        if os.environ.get("TVM_THREAD_POOL_SPIN_COUNT"):  # a negative or huge count spins forever
            env_int("TVM_THREAD_POOL_SPIN_COUNT", 0, MAX_SPIN_YIELDS)
        os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", str(SPIN_YIELDS))
        # first: it loads libtvm_ffi.so, which libtvm_runtime.so links against. Without ml_dtypes, which it imports
        # only to name numpy's bfloat16 and float8 types (kernels take float32 and integer tensors): 2 MiB; and
        # without torch where the process has not imported it (a run from a plan recipe: half a second and 300 MiB;
        # torch tensors imported later still pass, through the DLPack protocol)
        blocked = [name for name in ("ml_dtypes", "torch") if name not in sys.modules]
        for name in blocked:
            sys.modules[name] = None  # (an import of it raises ImportError, which tvm_ffi expects)
        try:
            import tvm_ffi
        finally:
            for name in blocked:
                if sys.modules.get(name, 0) is None:
                    del sys.modules[name]

        ctypes.CDLL(tvm_runtime_library(), mode=ctypes.RTLD_GLOBAL)

        _ffi_module = tvm_ffi
    return _ffi_module


class KernelLibrary:
    """The functions of one compiled spec as attributes (``spec.functions``: for a ``KernelSpec``
    ``build_tables``, ``lut_gemv``, ``lut_gemm``; for a ``GlueSpec`` the decode glue). Each call gives the GIL
    away while it runs; ``holding_gil`` has the same functions keeping it."""

    def __init__(self, spec, path: str, module=None, release_gil: bool = True):
        self.spec = spec
        self.path = path
        module = module if module is not None else ffi().load_module(path)
        for name in spec.functions:
            function = module[name]  # (a handle of its own: its release_gil is this library's)
            function.release_gil = release_gil
            setattr(self, name, function)
        self._module = module  # keeps the library loaded
        self._holding = None if release_gil else self

    @property
    def holding_gil(self) -> "KernelLibrary":
        """The functions keeping the GIL while they run: for a run of short calls from one thread (a decode step's
        hundreds, each well under a millisecond). A call that gives the GIL away must take it back on return, and
        while another Python thread works (a server's event loop) that waits for that thread's next switch (up to
        ``sys.getswitchinterval()``, 5 ms): a step's calls each waiting made it a hundred times slower. A thread
        holding it still gives it up at the interpreter's switches between calls."""
        if self._holding is None:
            self._holding = KernelLibrary(self.spec, self.path, self._module, release_gil=False)
        return self._holding


def load_kernels(spec, isa, kernel_dir: str | None = None, progress: bool = True) -> KernelLibrary:
    """The compiled kernels of ``spec`` (a ``KernelSpec`` or ``GlueSpec``): from ``kernel_dir``/``$TMAC_KERNEL_DIR``,
    else the cache, else compiled now."""
    from tmac.kernels import check_runnable

    check_runnable(isa)
    kernel_dir = kernel_dir or os.environ.get("TMAC_KERNEL_DIR") or None
    key = (spec.name, kernel_dir)
    with _lock:
        lib = _loaded.get(key)
        if lib is None:
            path = _from_kernel_dir(spec, isa, kernel_dir) if kernel_dir else None
            lib = KernelLibrary(spec, path or _from_cache(spec, isa, progress))
            _loaded[key] = lib
    return lib


def _from_kernel_dir(spec: KernelSpec, isa, kernel_dir: str) -> str | None:
    try:
        info, entries = read_manifest(os.path.join(kernel_dir, MANIFEST))
    except ValueError as e:
        raise KernelUnavailableError(f"kernel directory {kernel_dir}: {e}") from None
    if (info.get("arch"), info.get("isa")) != (isa.arch, isa.name):
        if kernel_dir not in warned_dirs:
            warned_dirs.add(kernel_dir)
            warnings.warn(f"kernel directory {kernel_dir} holds kernels for {info.get('arch')}/{info.get('isa')}, but "
                          f"this machine runs {isa.arch}/{isa.name}: none of them is used (compile for this machine "
                          f"with tmac compile --isa {isa.name})", stacklevel=4)
        return None
    named = [e for e in entries if isinstance(e, dict) and e.get("name") == spec.name]
    if named and not any(e.get("generator") == generator_digest() for e in named) and kernel_dir not in warned_dirs:
        warned_dirs.add(kernel_dir)
        warnings.warn(f"kernel directory {kernel_dir} was compiled by another version of tmac's code generator: its "
                      f"kernels are not used (compile it again with this tmac)", stacklevel=4)
    for entry in named:
        if entry.get("generator") == generator_digest():
            path = os.path.join(kernel_dir, os.path.basename(str(entry.get("file", ""))))
            check_entry(path, isa.arch, entry, MANIFEST)
            return path
    return None


def build_into(spec, isa, path: str) -> dict:
    """Compile ``spec``'s library for ``isa`` to ``path``, whole or not at all (``tmac.base.files.write_atomically``);
    returns its manifest entry. Imports TVM: only where a kernel is missing."""
    from tmac.codegen.build import build_library

    def build(tmp: str) -> dict:
        build_library(spec, isa, tmp)
        return kernel_entry(spec, isa, os.path.basename(path), sha256(tmp), os.path.getsize(tmp))

    return write_atomically(path, build, "build", suffix=".so", mode=0o644)


def _from_cache(spec: KernelSpec, isa, progress: bool) -> str:
    d = cache_dir()
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
    except OSError:
        pass
    if unsafe_dir_reason(d) is None:  # read even when read-only
        found = cached_library(d, spec, isa)
        if found:
            return found
        from tmac.execution.prefetch import wait_for

        wait_for(spec.name)  # (a child compiling it ahead: loaded when it is done)
        found = cached_library(d, spec, isa)
        if found:
            return found
    d = writable_cache(d)
    check_room(d, KERNEL_ROOM)  # before anything is written: a compiler that runs out of room aborts the process
    lock = os.path.join(d, spec.name + ".lock")
    fd, built = lock_file(lock), False  # another process may be compiling the same kernel
    try:
        found = cached_library(d, spec, isa)
        if found:
            built = True
            return found
        so, meta = os.path.join(d, spec.name + ".so"), os.path.join(d, spec.name + ".json")
        t0 = time.perf_counter()
        if progress:
            print(f"tmac: compiling kernel {spec.name} for {isa.name} ...", end="", file=sys.stderr, flush=True)
        try:
            entry = build_into(spec, isa, so)
        except Exception:
            if progress:
                print(" failed", file=sys.stderr, flush=True)
            raise
        atomic_write_text(meta, json.dumps(entry, indent=1))
        if progress:
            print(f" {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        built = True
        return so
    finally:
        if not built:  # no lock file left behind by a compile that failed (a waiter that locked it compiles anew)
            with contextlib.suppress(OSError):
                if os.path.samestat(os.fstat(fd), os.lstat(lock)):
                    os.unlink(lock)
        os.close(fd)
