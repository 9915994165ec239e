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
import sys
import tempfile
import threading
import time
import warnings

from .cpu import physical_cores
from .errors import KernelUnavailableError
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
    tmac) on the cores the kernels' pool needs. 1B TQ2_0 on 2 threads, torch imported first: decode 57 -> 92
    tok/s, prefill 104 -> 177; imported after tmac: prefill 166 -> 170."""
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
SPIN_YIELDS = 4000  # TVM_THREAD_POOL_SPIN_COUNT unless set: ~3 ms at 0.8 µs per sched_yield here


def ffi():
    """The ``tvm_ffi`` module, with ``libtvm_runtime.so`` preloaded (compiled kernels need its hooks)."""
    global _ffi_module
    if _ffi_module is None:
        # the pool is created with TVM_NUM_THREADS workers (TVM's default is half the cores); allow all of them,
        # set_num_threads() then narrows per call site
        os.environ.setdefault("TVM_NUM_THREADS", str(max(os.cpu_count() or 1, 1)))
        # idle workers spin (sched_yield) a few ms before sleeping: waking a sleeping worker costs 10-20 µs on a VM,
        # as much as a whole small GEMV, while the gaps between kernel calls of a decode step are µs. TVM spins
        # ~300k yields (a fraction of a second) by default, too long beside torch ops sharing the cores. SmolLM2,
        # 121-token prefill + 48 tokens on 2 threads: 364 ms sleeping, 253 ms at 1000 yields, 257 at 4000 (the
        # default here), 236 ms at 300k.
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


@functools.cache
def generator_digest() -> str:
    """A hash of the source that decides what a spec compiles to (codegen, the ISA primitives, the layouts and
    spec definitions): part of every cache key and manifest entry, so kernels built by other code are never used."""
    h = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    packages = [importlib.util.find_spec(f"{__package__}.{name}").submodule_search_locations[0]
                for name in ("codegen", "kernels")]
    files = [os.path.join(d, f) for d in packages for f in os.listdir(d) if f.endswith(".py")]
    for path in sorted(files) + [os.path.join(here, "packing.py"), os.path.join(here, "glue.py")]:
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read())
    return h.hexdigest()[:16]


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
        with open(path) as f:
            manifest = json.load(f)
        kernels = manifest["kernels"]
        if not isinstance(kernels, list):
            raise TypeError("'kernels' is not a list")
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
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
ELF_MACHINES = {"x86_64": 62, "arm64": 183}  # e_machine: EM_X86_64, EM_AARCH64


def check_library(path: str, arch: str, size: int | None = None) -> None:
    """Raise ``KernelUnavailableError`` unless ``path`` is a regular file holding a little-endian 64-bit ELF shared
    object for ``arch`` (of ``size`` bytes when given): what is loaded into the process is at least that."""
    import stat
    import struct

    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise KernelUnavailableError(f"{path}: not a regular file")
        with open(path, "rb") as f:
            header = f.read(64)
    except OSError as e:
        raise KernelUnavailableError(f"{path}: cannot read ({e.strerror})") from None
    if size is not None and st.st_size != size:
        raise KernelUnavailableError(f"{path}: {st.st_size} bytes, its manifest says {size}")
    if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
        raise KernelUnavailableError(f"{path}: not a 64-bit little-endian ELF file")
    e_type, e_machine = struct.unpack_from("<HH", header, 16)
    if e_type != 3 or e_machine != ELF_MACHINES[arch]:
        raise KernelUnavailableError(f"{path}: ELF type {e_type} for machine {e_machine}, not a shared object for "
                                     f"{arch} (type 3, machine {ELF_MACHINES[arch]})")


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
    for entry in entries:
        if isinstance(entry, dict) and entry.get("name") == spec.name \
                and entry.get("generator") == generator_digest():
            path = os.path.join(kernel_dir, os.path.basename(str(entry.get("file", ""))))
            size = entry.get("bytes")
            check_library(path, isa.arch, size if isinstance(size, int) else None)
            if sha256(path) != entry.get("sha256"):
                raise KernelUnavailableError(f"kernel directory {kernel_dir}: {entry.get('file')} does not match "
                                             f"its sha256 in manifest.json")
            return path
    return None


def _writable_cache() -> str:
    d = cache_dir()
    try:
        os.makedirs(d, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=d, prefix=".probe-")
        probe.close()
        return d
    except OSError as e:
        fallback = os.path.join(tempfile.gettempdir(), f"tmac-cache-{os.getuid()}", os.path.basename(d))
        warnings.warn(f"kernel cache {d} is not writable ({e.strerror}); using {fallback}", stacklevel=3)
        os.makedirs(fallback, exist_ok=True)
        return fallback


def _valid_cached(so: str, meta: str, spec: KernelSpec) -> bool:
    try:
        with open(meta) as f:
            entry = json.load(f)
        return entry.get("spec") == dataclasses.asdict(spec) and sha256(so) == entry.get("sha256")
    except (OSError, ValueError, AttributeError):
        return False


def _from_cache(spec: KernelSpec, isa, progress: bool) -> str:
    d = _writable_cache()
    so, meta = os.path.join(d, spec.name + ".so"), os.path.join(d, spec.name + ".json")
    if _valid_cached(so, meta, spec):
        return so
    with open(os.path.join(d, spec.name + ".lock"), "w") as lockfile:
        fcntl.flock(lockfile, fcntl.LOCK_EX)  # another process may be compiling the same kernel
        if _valid_cached(so, meta, spec):
            return so
        from .codegen.build import build_library  # imports TVM: only on a cache miss

        t0 = time.perf_counter()
        if progress:
            print(f"tmac: compiling kernel {spec.name} for {isa.name} ...", end="", file=sys.stderr, flush=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".build-", suffix=".so")
        os.close(fd)
        try:
            build_library(spec, isa, tmp)
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


def _atomic_write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
