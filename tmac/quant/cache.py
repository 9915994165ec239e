"""The kernel cache: where compiled kernels live (``cache_dir``: keyed by TVM's version and a digest of the code
that generates them), the manifest of a ``tmac compile`` directory, and the checks a library passes before it is
loaded. Cache directories are untrusted: an entry that is damaged, not this user's, or in a directory others can
write is moved aside or not used."""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import stat
import tempfile
import time
import warnings

from tmac.base.elf import check_library
from tmac.base.errors import KernelUnavailableError
from tmac.base.files import read_json, write_atomically
from tmac.quant.spec import KernelSpec


@functools.cache
def tvm_version() -> str:
    """apache-tvm's version (the kernel cache's folder names it): from its ``.dist-info`` folder's name beside the
    package, as ``importlib.metadata`` reads it, without the 20-30 ms of importing that and scanning every
    distribution a run without torch would otherwise spend."""
    spec = importlib.util.find_spec("tvm")
    if spec is not None and spec.submodule_search_locations:
        site = os.path.dirname(spec.submodule_search_locations[0])
        found = [n for n in os.listdir(site) if n.startswith("apache_tvm-") and n.endswith(".dist-info")]
        if len(found) == 1:
            return found[0][len("apache_tvm-"):-len(".dist-info")]
    from importlib import metadata

    try:
        return metadata.version("apache-tvm")
    except metadata.PackageNotFoundError:
        raise KernelUnavailableError("apache-tvm is not installed") from None


def generator_sources() -> list[str]:
    """The files whose code decides what a spec compiles to: every module of ``tmac.codegen`` and ``tmac.kernels``
    and every tmac module they import, transitively, as their import statements say (so a module codegen starts to
    import joins the key by itself). Found by path, importing nothing."""
    import ast

    packages = {name: importlib.util.find_spec(name).submodule_search_locations[0]
                for name in ("tmac", "tmac.codegen", "tmac.kernels", "tmac.models")}

    def folder(package: str) -> str | None:
        """A tmac package's folder, its subpackages' found inside their parent's (``tmac.base``, ``tmac.models.run``)."""
        if package not in packages:
            parent, _, leaf = package.rpartition(".")
            where = folder(parent) if parent.startswith("tmac") else None
            packages[package] = os.path.join(where, leaf) if where and os.path.isdir(os.path.join(where, leaf)) \
                else None
        return packages[package]

    def module_file(name: str) -> str | None:
        if name.startswith("tmac") and folder(name) is not None:
            return os.path.join(packages[name], "__init__.py")
        package, _, leaf = name.rpartition(".")
        where = folder(package) if package.startswith("tmac") else None
        path = os.path.join(where, leaf + ".py") if where else None
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
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
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
    and manifest entry, so kernels built by other code are never used. Finding the sources parses them (a tenth
    of a second of every start), so the digest is kept in the cache with the files' sizes and modification times
    (and the packages' folders', which change when a module is added), as Python keeps its bytecode: any change
    finds the sources again."""
    record = os.path.join(cache_root(), "generator.json")
    # (where this tmac's packages are: a checkout and an installed copy share a cache)
    roots = [importlib.util.find_spec(n).submodule_search_locations[0] for n in ("tmac", "tmac.codegen", "tmac.kernels")]
    try:  # trusted as a kernel is: a file of this user's, in a directory no one else writes (a planted digest of
        # older code would pass kernels compiled by it)
        st = os.lstat(record)
        if unsafe_dir_reason(cache_root()) is None and stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and \
                not st.st_mode & 0o022:
            saved = read_json(record, 1 << 20)
            if isinstance(saved, dict) and saved.get("roots") == roots and isinstance(saved.get("digest"), str) \
                    and saved.get("stats") == _stats(saved.get("files")):
                return saved["digest"]
    except (OSError, ValueError, TypeError):
        pass
    paths = generator_sources()
    digest = source_digest(paths)
    files = paths + [os.path.dirname(p) for p in paths if os.path.basename(p) == "__init__.py"]
    try:
        os.makedirs(cache_root(), mode=0o700, exist_ok=True)
        if unsafe_dir_reason(cache_root()) is None:
            atomic_write_text(record, json.dumps({"roots": roots, "files": files, "stats": _stats(files),
                                                  "digest": digest}))
    except OSError:  # (a read-only cache: found again next time)
        pass
    return digest


def _stats(files) -> list | None:
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    out = []
    for path in files:
        st = os.stat(path)
        out.append([st.st_mtime_ns, st.st_size])
    return out


def cache_root() -> str:
    return os.environ.get("TMAC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tmac")


def cache_dir() -> str:
    return os.path.join(cache_root(), f"tvm-{tvm_version()}-{generator_digest()}")


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def spec_record(spec) -> dict:
    """A kernel's or glue spec's fields as JSON holds them (``KernelSpec.record``)."""
    return spec.record() if isinstance(spec, KernelSpec) else dataclasses.asdict(spec)


def kernel_entry(spec: KernelSpec, isa, file: str, digest: str, size: int) -> dict:
    """What a manifest records about one compiled kernel."""
    return {"name": spec.name, "file": file, "isa": isa.name, "arch": isa.arch, "target": isa.target,
            "tvm_version": tvm_version(), "generator": generator_digest(), "sha256": digest, "bytes": size,
            "spec": spec_record(spec)}


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
    atomic_write_text(os.path.join(directory, MANIFEST), json.dumps(manifest, indent=1))


def add_to_manifest(directory: str, isa, entries: dict[str, dict]) -> int:
    """Add ``entries`` (by name) to ``directory``'s manifest: read, merged and written under a lock, so that
    processes compiling into one directory at once keep each other's kernels. Returns how many it lists."""
    fd = lock_file(os.path.join(directory, ".manifest.lock"))
    try:
        merged = {**read_manifest_for_update(directory, isa), **entries}
        write_manifest(directory, isa, list(merged.values()))
        return len(merged)
    finally:
        os.close(fd)


warned_dirs: set[str] = set()


def check_entry(path: str, arch: str, entry: dict, record: str) -> None:
    """``check_library`` against the size ``entry`` records, then its sha256 (``record``: where the entry is)."""
    size = entry.get("bytes")
    check_library(path, arch, size if type(size) is int else None)
    if sha256(path) != entry.get("sha256"):
        raise KernelUnavailableError(f"{path}: does not match the sha256 in {record}")


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


def writable_cache(d: str) -> str:
    """``d`` when this process may compile into it, else a private directory (saying why, once)."""
    problem = unsafe_dir_reason(d)
    if problem is None and os.access(d, os.W_OK):
        return d
    private = _private_cache()
    if d not in warned_dirs:
        warned_dirs.add(d)
        warnings.warn(f"kernel cache {d} {problem or 'is read-only'}: kernels compiled now go to {private} for this "
                      f"process only (set TMAC_CACHE_DIR to a directory of your own)", stacklevel=4)
    return private


def cached_library(d: str, spec: KernelSpec, isa) -> str | None:
    """The library of ``spec`` in cache directory ``d`` if a sound one is there; a damaged entry (unreadable, not a
    regular file, not this user's, not matching its sidecar, not an ELF library for ``isa``) is moved aside with a
    warning, so that it is rebuilt, and None returned."""
    so, meta = os.path.join(d, spec.name + ".so"), os.path.join(d, spec.name + ".json")
    if not os.path.lexists(so) and not os.path.lexists(meta):
        return None
    try:
        entry = read_json(meta, 1 << 20)
        if not isinstance(entry, dict) or entry.get("spec") != spec_record(spec):
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
    if os.path.lexists(aside) and not (os.path.isdir(aside) and not os.path.islink(aside)):
        os.replace(aside, os.path.join(d, f".damaged-not-a-directory.{time.time_ns()}"))  # its place is needed
    os.makedirs(aside, mode=0o700, exist_ok=True)
    stamp = f"{time.time_ns()}"
    moved = []
    for path in paths:
        if os.path.lexists(path):
            os.replace(path, os.path.join(aside, f"{os.path.basename(path)}.{stamp}"))
            moved.append(os.path.basename(path))
    warnings.warn(f"kernel cache: damaged entry {', '.join(moved)} moved to {aside} and rebuilt ({why})",
                  stacklevel=5)


def lock_file(path: str) -> int:
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


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (``tmac.base.files.write_atomically``)."""
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    write_atomically(path, write, "write", mode=0o644, needed=len(text))
