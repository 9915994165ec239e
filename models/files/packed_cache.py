"""Packed copies of the GGUF files tmac runs, so that a file is decoded and packed once: the first load writes the
packed model beside the kernel cache (a ``.tmac`` file, as ``tmac convert`` writes), later loads map it.

A copy is keyed by the source file's identity (device, inode, size, modification time, and a hash of its first and
last 64 KiB) and by what its layout depends on (the ISA, the kernel generator's digest, the tiling table, the code
that picks tilings, packs and writes the file, in tmac's file format): a changed file, another ISA or other kernels miss and write a new
copy; a copy that must still be repacked as it loads (packed by other code under the same key) is written again. Copies are written
atomically (a temporary file renamed: a reader mapping the old one keeps it), are checked as any ``.tmac`` file is
when loaded (a damaged one is removed and rebuilt from the source), and are bounded in total size
(``TMAC_MODEL_CACHE_GB``, default 20): the least recently used go first. ``TMAC_MODEL_CACHE=0`` turns it off.

A run that writes a copy can go on meanwhile (``store_behind``: the command line does): the copy is written on a
thread from the packed model the run computes with, and the process ends only after it is whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import threading
import time
import warnings

from tmac.base import files

SAMPLE = 64 << 10  # bytes hashed at each end of a source file
# the code a copy's bytes depend on (``layout``; the .tmac format's version is tmac_file's code too)
PACKER_MODULES = ("tmac.quant.choose", "tmac.execution.packing", "tmac.quant.kquant", "tmac.quant.quantize",
                  "tmac.quant.embedding", "tmac.models.files.tmac_file", "tmac.base.formats", "tmac.base.gguf_blocks")
DEFAULT_GB = 20.0
_WRITING: dict[str, threading.Thread] = {}  # copies being written behind a run, by key
BEHIND_NICE = 10


def enabled() -> bool:
    return os.environ.get("TMAC_MODEL_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def directory() -> str:
    from tmac.quant.cache import cache_root

    return os.path.join(cache_root(), "models")


def limit_bytes() -> int:
    text = os.environ.get("TMAC_MODEL_CACHE_GB", "").strip()
    try:
        gb = float(text) if text else DEFAULT_GB
    except ValueError:
        raise ValueError(f"TMAC_MODEL_CACHE_GB={text!r}: a number of GiB is needed") from None
    if not gb >= 0:
        raise ValueError(f"TMAC_MODEL_CACHE_GB={text!r} must be >= 0")
    return int(gb * 2 ** 30)


def identity(path: str) -> dict:
    """What says a source file is the one a copy was made from."""
    st = os.stat(path)
    h = hashlib.sha256()
    with open(files.require_regular(path), "rb") as f:
        h.update(f.read(SAMPLE))
        if st.st_size > 2 * SAMPLE:
            f.seek(st.st_size - SAMPLE)
            h.update(f.read(SAMPLE))
    return {"path": os.path.realpath(path), "device": st.st_dev, "inode": st.st_ino, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "sample_sha256": h.hexdigest()}


def layout() -> dict:
    """What a packed copy's bytes depend on besides the source: the ISA, the generator, the tilings chosen (the tuning
    table and the code of the defaults), the packing and the importers. (A copy packed otherwise would still load
    correctly, repacked layer by layer on every load: seconds and a second copy of the weights each run.)"""
    from tmac.kernels import best_isa
    from tmac.quant.cache import generator_digest, source_digest

    tuning = None
    try:
        from tmac.quant.choose import tuning_file

        with open(tuning_file(), "rb") as f:
            tuning = hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        pass
    # (the modules' files, found without importing them: a run from a recipe never imports torch)
    packer = source_digest([importlib.util.find_spec(m).origin for m in PACKER_MODULES])
    return {"isa": best_isa().name, "generator": generator_digest(), "packer": packer, "tuning": tuning}


def key_of(ident: dict, lay: dict) -> str:
    text = json.dumps({"source": ident, "layout": lay}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def lookup(path: str, options: dict) -> tuple[str, str | None]:
    """The key of ``path``'s copy loaded with ``options`` (bits, group size, head bits) and the copy's path where
    one exists."""
    key = key_of({**identity(path), "options": options}, layout())
    wait(key)  # (this process's own copy of it, still being written)
    copy = os.path.join(directory(), key + ".tmac")
    return key, copy if os.path.isfile(copy) else None


def touch(key: str) -> None:
    """Mark a copy as used now (its index file's time: what eviction orders by)."""
    try:
        os.utime(os.path.join(directory(), key + ".json"))
    except OSError:
        pass


def store(key: str, source: str, model) -> str | None:
    """Write ``model`` as ``source``'s packed copy, atomically, after making room; the copy's path, or None where it
    cannot be written (no room, a read-only cache: the model runs all the same)."""
    from tmac.models.files.tmac_file import save_model

    where = directory()
    try:
        os.makedirs(where, mode=0o700, exist_ok=True)
        need = _tensor_bytes(model)
        if need > limit_bytes():
            return None
        evict(limit_bytes() - need, keep=key)
        files.check_room(where, need + (64 << 20))
        copy = os.path.join(where, key + ".tmac")
        save_model(model, copy)
        entry = {"source": os.path.realpath(source), "key": key, "bytes": os.path.getsize(copy),
                 "created": time.time(), **{k: v for k, v in layout().items() if k in ("isa",)}}
        files.write_atomically(os.path.join(where, key + ".json"), lambda tmp: _write_json(tmp, entry), "write")
        return copy
    except Exception as e:  # the copy is a saving, never a reason for the run to fail
        warnings.warn(f"could not keep a packed copy of {source} in {where} ({e}); the next run packs it again",
                      stacklevel=4)
        remove(key)
        return None


def store_behind(key: str, source: str, model) -> None:
    """``store`` on a thread of its own while ``model`` runs (its weights are only read meanwhile): a first run's
    tokens do not wait for the copy's write. ``model.packed_copy`` is set once the copy is whole; the thread is not a
    daemon, so the process ends only after it (an interrupted write leaves a temporary that the next write removes).
    """
    def write():
        try:  # the run's own threads first (Linux: a thread's nice value is its own)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BEHIND_NICE)
        except (AttributeError, OSError):
            pass
        copy = store(key, source, model)
        if copy is not None:
            model.packed_copy = copy

    wait(key)
    thread = _WRITING[key] = threading.Thread(target=write, name="tmac packed copy")
    thread.start()


def writing() -> bool:
    """Whether this process is writing a copy behind a run."""
    return any(thread.is_alive() for thread in _WRITING.values())


def wait(key: str | None = None) -> None:
    """Until the copies this process writes behind its runs (the one of ``key``, or all) are whole or given up."""
    for k, thread in list(_WRITING.items()):
        if key is None or k == key:
            thread.join()
            if _WRITING.get(k) is thread:
                del _WRITING[k]


def _tensor_bytes(model) -> int:
    """The bytes of ``model``'s tensors, each storage once (a state dict would checksum every packed layer)."""
    seen = {}
    for t in (*model.parameters(), *model.buffers()):
        seen[(t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())] = t.numel() * t.element_size()
    return sum(seen.values())


def _write_json(path: str, value) -> None:
    with open(path, "w") as f:
        json.dump(value, f)


def entries() -> list[dict]:
    """The copies the cache holds, the most recently used first: source, key, bytes, last used."""
    where = directory()
    out = []
    try:
        names = os.listdir(where)
    except OSError:
        return []
    for name in names:
        if not name.endswith(".tmac") or name.startswith("."):
            continue
        key, copy = name[:-5], os.path.join(where, name)
        index = os.path.join(where, key + ".json")
        try:
            size = os.path.getsize(copy)
        except OSError:
            continue
        for recipe in (n for n in names if n.startswith(key + ".") and n.endswith(".plans")):  # (its plan recipes)
            try:
                size += os.path.getsize(os.path.join(where, recipe))
            except OSError:
                pass
        try:
            meta = files.read_json(index, 1 << 16)
            meta = meta if isinstance(meta, dict) else {}
            used = os.path.getmtime(index)
        except (OSError, ValueError):  # an index lost or damaged: the copy is listed, and goes first
            meta, used = {}, 0.0
        out.append({"key": key, "path": copy, "source": str(meta.get("source", "?")), "isa": str(meta.get("isa", "?")),
                    "bytes": size, "used": used})
    return sorted(out, key=lambda e: -e["used"])


def remove(key: str) -> None:
    """A copy, its index entry and the plan recipes written for it (``tmac.models.run.recipe``)."""
    recipes = [n for n in _listdir(directory()) if n.startswith(key + ".") and n.endswith(".plans")]
    for name in (key + ".tmac", key + ".json", *recipes):
        try:
            os.unlink(os.path.join(directory(), name))
        except FileNotFoundError:
            pass


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def evict(budget: int, keep: str | None = None) -> list[dict]:
    """Remove the least recently used copies until the rest take at most ``budget`` bytes; the removed."""
    held = entries()
    total, gone = sum(e["bytes"] for e in held), []
    for e in reversed(held):  # the least recently used first
        if total <= budget:
            break
        if e["key"] == keep:
            continue
        remove(e["key"])
        total -= e["bytes"]
        gone.append(e)
    return gone


def clear() -> list[dict]:
    """Remove every copy (and the plan recipes of converted files); the removed copies."""
    removed, where = evict(-1), directory()
    for name in _listdir(where):
        if name.endswith(".plans"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(where, name))
    return removed
