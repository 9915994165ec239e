"""Loading compiled kernels, the kernel cache, threads, and the checked calls into compiled code.

Kernels are shared libraries loaded with ``tvm_ffi`` after preloading ``libtvm_runtime.so`` (which fills the
thread-pool and workspace hooks the libraries call), so running with cached kernels never imports ``tvm``;
only a cache miss imports ``tmac.codegen`` (and with it TVM) to compile.

Cache: ``$TMAC_CACHE_DIR`` or ``~/.cache/tmac``, one subdirectory per TVM version and kernel generator version, one ``<spec>.so`` plus a
``<spec>.json`` sidecar (spec, ISA, TVM version, sha256) per kernel. Writes go to a temporary file and are
renamed into place under a file lock, so concurrent processes never load a half-written library; a library
whose hash does not match its sidecar is rebuilt, never loaded. ``$TMAC_KERNEL_DIR`` (or an explicit
directory) with a ``manifest.json`` written by ``tmac compile`` is looked in first.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import stat
import sys
import tempfile
import threading
import time
import warnings

from .cpu import physical_cores
from .elf import check_library
from .errors import KernelUnavailableError
from .files import read_json
from .packing import KernelSpec

_lock = threading.Lock()
_loaded: dict[tuple[str, str | None], "KernelLibrary"] = {}
_num_threads = 0
_local = threading.local()


# ---- threads ------------------------------------------------------------------------------------------------

def _default_threads() -> int:
    env = os.environ.get("TMAC_NUM_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"TMAC_NUM_THREADS must be a positive integer, got {env!r}") from None
        if n >= 1:
            return n
        raise ValueError(f"TMAC_NUM_THREADS must be a positive integer, got {env!r}")
    return physical_cores()


def set_num_threads(n: int) -> None:
    """Threads the kernels use (default: ``$TMAC_NUM_THREADS`` or the number of physical cores)."""
    global _num_threads
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"number of threads must be a positive int, got {n!r}")
    _num_threads = n


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


@contextlib.contextmanager
def torch_single_threaded():
    """Run torch on one thread inside the block, for code whose heavy work is in the kernels: each multi-threaded
    torch op between kernel calls leaves torch's OpenMP workers spinning (actively, if torch was imported before
    tmac) on the cores the kernels' pool needs (docs/decisions.md, "torch on one thread")."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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


def ffi():
    """The ``tvm_ffi`` module, with ``libtvm_runtime.so`` preloaded (compiled kernels need its hooks)."""
    global _ffi_module
    if _ffi_module is None:
        # the pool is created with TVM_NUM_THREADS workers (TVM's default is half the cores); allow all of them,
        # set_num_threads() then narrows per call site
        os.environ.setdefault("TVM_NUM_THREADS", str(max(os.cpu_count() or 1, 1)))
        # idle workers spin (sched_yield) a few ms before sleeping: waking a sleeping worker costs as much as a small
        # GEMV, while the gaps between a decode step's kernel calls are µs; TVM's own default spins far longer, too
        # long beside torch ops sharing the cores (docs/decisions.md, "TVM's idle workers")
        os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", str(SPIN_YIELDS))
        import tvm_ffi  # first: it loads libtvm_ffi.so, which libtvm_runtime.so links against

        ctypes.CDLL(tvm_runtime_library(), mode=ctypes.RTLD_GLOBAL)

        _ffi_module = tvm_ffi
    return _ffi_module


def tvm_version() -> str:
    try:
        return importlib.metadata.version("apache-tvm")
    except importlib.metadata.PackageNotFoundError:
        raise KernelUnavailableError("apache-tvm is not installed") from None


def generator_sources() -> list[str]:
    """The files whose code decides what a spec compiles to: every module of ``tmac.codegen`` and ``tmac.kernels``
    and every tmac module they import, transitively, as their import statements say (so a module codegen starts to
    import joins the key by itself). Found by path, importing nothing."""
    import ast

    packages = {name: importlib.util.find_spec(name).submodule_search_locations[0]
                for name in ("tmac", "tmac.codegen", "tmac.kernels", "tmac.models")}

    def module_file(name: str) -> str | None:
        if name in packages:
            return os.path.join(packages[name], "__init__.py")
        package, _, leaf = name.rpartition(".")
        path = os.path.join(packages[package], leaf + ".py") if package in packages else None
        return path if path and os.path.isfile(path) else None

    todo = ["tmac.codegen", "tmac.kernels"] + [f"{pkg}.{f[:-3]}" for pkg in ("tmac.codegen", "tmac.kernels")
                                               for f in os.listdir(packages[pkg]) if f.endswith(".py")]
    files: dict[str, str] = {}
    while todo:
        name = todo.pop()
        path = None if name in files else module_file(name)
        if path is None:  # not a tmac module (or a name imported from one)
            continue
        files[name] = path
        package = name if name in packages else name.rpartition(".")[0]
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                todo += [base] + [f"{base}.{a.name}" for a in node.names]  # `from . import glue`: submodules
    # in module-name order: the same in a checkout (codegen/, tmac/) and an installed wheel (tmac/codegen/)
    return list(dict.fromkeys(files[name] for name in sorted(files)))


def source_digest(paths: list[str]) -> str:
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read())
    return h.hexdigest()[:16]


@functools.cache
def generator_digest() -> str:
    """A hash of the source that decides what a spec compiles to (``generator_sources``): part of every cache key
    and manifest entry, so kernels built by other code are never used."""
    return source_digest(generator_sources())


def cache_dir() -> str:
    root = os.environ.get("TMAC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tmac")
    return os.path.join(root, f"tvm-{tvm_version()}-{generator_digest()}")


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def kernel_entry(spec: KernelSpec, isa, file: str, digest: str, size: int) -> dict:
    """What a manifest records about one compiled kernel."""
    return {"name": spec.name, "file": file, "isa": isa.name, "arch": isa.arch, "target": isa.target,
            "tvm_version": tvm_version(), "generator": generator_digest(), "sha256": digest, "bytes": size,
            "spec": dataclasses.asdict(spec)}


MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1


def read_manifest_for_update(directory: str, isa) -> dict[str, dict]:
    """The kernel entries (by name) of ``directory``'s manifest that ``tmac compile`` keeps when it adds kernels
    for ``isa``: all of them when the directory holds kernels of that ISA, none when it holds none. A directory
    of another ISA is refused: one directory, one ISA, as the runtime reads it."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        return {}
    try:
        manifest, kernels = read_manifest(path)
    except ValueError as e:
        raise ValueError(f"{e}; choose another --output") from None
    if (manifest.get("arch"), manifest.get("isa")) != (isa.arch, isa.name):
        raise ValueError(f"{directory} holds kernels for {manifest.get('arch')}/{manifest.get('isa')}, not "
                         f"{isa.arch}/{isa.name}: choose another --output")
    return {e["name"]: e for e in kernels if isinstance(e, dict) and isinstance(e.get("name"), str)
            and e.get("generator") == generator_digest()}


def read_manifest(path: str) -> tuple[dict, list]:
    """A manifest and its kernel entries; ``ValueError`` naming the file when it is not one."""
    try:
        manifest = read_json(path, 16 << 20)
        kernels = manifest["kernels"]
        if not isinstance(kernels, list):
            raise TypeError("'kernels' is not a list")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read {os.path.basename(path)} ({type(e).__name__}: {e})") from None
    return manifest, kernels


def write_manifest(directory: str, isa, entries: list[dict]) -> None:
    manifest = {"format": MANIFEST_FORMAT, "arch": isa.arch, "isa": isa.name, "tvm_version": tvm_version(),
                "kernels": entries}
    _atomic_write_text(os.path.join(directory, MANIFEST + ".tmp"), json.dumps(manifest, indent=1))
    os.replace(os.path.join(directory, MANIFEST + ".tmp"), os.path.join(directory, MANIFEST))


class KernelLibrary:
    """The functions of one compiled spec as attributes (``spec.functions``: for a ``KernelSpec``
    ``build_tables``, ``lut_gemv``, ``lut_gemm``; for a ``GlueSpec`` the decode glue)."""

    def __init__(self, spec, path: str):
        self.spec = spec
        self.path = path
        module = ffi().load_module(path)
        for name in spec.functions:
            setattr(self, name, module[name])
        self._module = module  # keeps the library loaded


def load_kernels(spec, isa, kernel_dir: str | None = None, progress: bool = True) -> KernelLibrary:
    """The compiled kernels of ``spec`` (a ``KernelSpec`` or ``GlueSpec``): from ``kernel_dir``/``$TMAC_KERNEL_DIR``,
    else the cache, else compiled now."""
    from .kernels import check_runnable

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


_warned_dirs: set[str] = set()


def check_entry(path: str, arch: str, entry: dict, record: str) -> None:
    """``check_library`` against the size ``entry`` records, then its sha256 (``record``: where the entry is)."""
    size = entry.get("bytes")
    check_library(path, arch, size if type(size) is int else None)
    if sha256(path) != entry.get("sha256"):
        raise KernelUnavailableError(f"{path}: does not match the sha256 in {record}")


def _from_kernel_dir(spec: KernelSpec, isa, kernel_dir: str) -> str | None:
    try:
        info, entries = read_manifest(os.path.join(kernel_dir, MANIFEST))
    except ValueError as e:
        raise KernelUnavailableError(f"kernel directory {kernel_dir}: {e}") from None
    if (info.get("arch"), info.get("isa")) != (isa.arch, isa.name):
        if kernel_dir not in _warned_dirs:
            _warned_dirs.add(kernel_dir)
            warnings.warn(f"kernel directory {kernel_dir} holds kernels for {info.get('arch')}/{info.get('isa')}, but "
                          f"this machine runs {isa.arch}/{isa.name}: none of them is used (compile for this machine "
                          f"with tmac compile --isa {isa.name})", stacklevel=4)
        return None
    named = [e for e in entries if isinstance(e, dict) and e.get("name") == spec.name]
    if named and not any(e.get("generator") == generator_digest() for e in named) and kernel_dir not in _warned_dirs:
        _warned_dirs.add(kernel_dir)
        warnings.warn(f"kernel directory {kernel_dir} was compiled by another version of tmac's code generator: its "
                      f"kernels are not used (compile it again with this tmac)", stacklevel=4)
    for entry in named:
        if entry.get("generator") == generator_digest():
            path = os.path.join(kernel_dir, os.path.basename(str(entry.get("file", ""))))
            check_entry(path, isa.arch, entry, MANIFEST)
            return path
    return None


_private: list[str] = []  # this process's own cache directory, when the shared one cannot be used


def unsafe_dir_reason(path: str) -> str | None:
    """Why libraries in directory ``path`` must not be loaded (None: they may): it must be a real directory owned
    by this user and writable by no one else, as ssh requires of its keys' — else another user could plant code."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not this user ({os.getuid()})"
    if st.st_mode & 0o022:
        return f"is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _private_cache() -> str:
    """A directory of this process's own (``mkdtemp``: random name, mode 700), removed at exit."""
    if not _private:
        import atexit
        import shutil

        _private.append(tempfile.mkdtemp(prefix="tmac-kernels-"))
        atexit.register(shutil.rmtree, _private[0], True)
    return _private[0]


def _cache_for_writing(d: str) -> str:
    """``d`` when this process may compile into it, else a private directory (saying why, once)."""
    problem = unsafe_dir_reason(d)
    if problem is None and os.access(d, os.W_OK):
        return d
    private = _private_cache()
    if d not in _warned_dirs:
        _warned_dirs.add(d)
        warnings.warn(f"kernel cache {d} {problem or 'is read-only'}: kernels compiled now go to {private} for this "
                      f"process only (set TMAC_CACHE_DIR to a directory of your own)", stacklevel=4)
    return private


def _cached(d: str, spec: KernelSpec, isa) -> str | None:
    """The library of ``spec`` in cache directory ``d`` if a sound one is there; a damaged entry (unreadable, not a
    regular file, not this user's, not matching its sidecar, not an ELF library for ``isa``) is moved aside with a
    warning, so that it is rebuilt, and None returned."""
    so, meta = os.path.join(d, spec.name + ".so"), os.path.join(d, spec.name + ".json")
    if not os.path.lexists(so) and not os.path.lexists(meta):
        return None
    try:
        entry = read_json(meta, 1 << 20)
        if not isinstance(entry, dict) or entry.get("spec") != dataclasses.asdict(spec):
            raise KernelUnavailableError(f"{meta}: its spec is not {spec.name}'s")
        st = os.lstat(so)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise KernelUnavailableError(f"{so}: not a regular file of this user's, writable by no one else")
        check_entry(so, isa.arch, entry, "its sidecar")
        return so
    except (OSError, ValueError, KernelUnavailableError) as e:
        if unsafe_dir_reason(d) is None and os.access(d, os.W_OK):
            _quarantine(d, [so, meta], e)
        return None


def _quarantine(d: str, paths: list[str], why: Exception) -> None:
    """Move damaged cache files aside (``.damaged/``, kept for a look) so the entry is rebuilt."""
    aside = os.path.join(d, ".damaged")
    os.makedirs(aside, mode=0o700, exist_ok=True)
    stamp = f"{time.time_ns()}"
    moved = []
    for path in paths:
        if os.path.lexists(path):
            os.replace(path, os.path.join(aside, f"{os.path.basename(path)}.{stamp}"))
            moved.append(os.path.basename(path))
    warnings.warn(f"kernel cache: damaged entry {', '.join(moved)} moved to {aside} and rebuilt ({why})",
                  stacklevel=5)


def _lock_file(path: str) -> int:
    """A file descriptor locked exclusively on ``path`` (a lock file; anything else there is moved aside first)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(f"{path} is not a regular file")
    except OSError as e:
        _quarantine(os.path.dirname(path), [path], e)
        fd = os.open(path, flags, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _from_cache(spec: KernelSpec, isa, progress: bool) -> str:
    d = cache_dir()
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
    except OSError:
        pass
    if unsafe_dir_reason(d) is None:  # read even when read-only
        found = _cached(d, spec, isa)
        if found:
            return found
    d = _cache_for_writing(d)
    fd = _lock_file(os.path.join(d, spec.name + ".lock"))  # another process may be compiling the same kernel
    try:
        found = _cached(d, spec, isa)
        if found:
            return found
        from .codegen.build import build_library  # imports TVM: only on a cache miss

        so, meta = os.path.join(d, spec.name + ".so"), os.path.join(d, spec.name + ".json")
        t0 = time.perf_counter()
        if progress:
            print(f"tmac: compiling kernel {spec.name} for {isa.name} ...", end="", file=sys.stderr, flush=True)
        fd_tmp, tmp = tempfile.mkstemp(dir=d, prefix=".build-", suffix=".so")
        os.close(fd_tmp)
        try:
            build_library(spec, isa, tmp)
            os.chmod(tmp, 0o644)
            entry = kernel_entry(spec, isa, os.path.basename(so), sha256(tmp), os.path.getsize(tmp))
            _atomic_write_text(meta + ".tmp", json.dumps(entry, indent=1))
            os.replace(tmp, so)
            os.replace(meta + ".tmp", meta)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        if progress:
            print(f" {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        return so
    finally:
        os.close(fd)


def _atomic_write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
