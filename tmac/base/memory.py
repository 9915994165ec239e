"""Memory the decode step streams, in 2 MiB pages where the OS offers them (Linux transparent huge pages).

A decode step reads every packed weight once; with 4 KiB pages that is one TLB miss per 4 KiB (302 MB a token
for a 1B model at 2 bits: 74k page walks), and the hardware prefetchers restart at every page. Linux backs a
range with 2 MiB pages when it is marked ``MADV_HUGEPAGE`` before it is first touched (the default THP mode,
``madvise``, does nothing for unmarked memory; docs/decisions.md, "Huge pages"). Elsewhere (no THP, not Linux)
this is plain memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import re
import sys
import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads with the first arena, not with ``tmac info``
    import numpy as np
    import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h>, the same on every Linux architecture
ALIGN = 64  # of each tensor placed in an arena: the kernels' vector loads want cache-line starts
# a packed tensor this large is made in huge pages of its own (``packed_empty``) and stays there: copying it into
# the arena would hold it twice for a moment (a 49152-row head: 28 MiB and more at the load's peak)
IN_PLACE_BYTES = 16 << 20
TRIM_EVERY = 8 << 20  # bytes gathered between handing freed memory back to the OS


def huge_page_mode() -> str:
    """The kernel's transparent-huge-page mode: ``always``, ``madvise`` (what tmac's arenas need), ``never``, or
    ``absent`` (not Linux, or no THP)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            found = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return "absent"
    return found.group(1) if found else "absent"


def peak_rss_mib(pid: int | str = "self") -> float | None:
    """Peak resident memory of a process in MiB: ``VmHWM`` from /proc — not ``ru_maxrss``, which a process started
    by a larger one inherits from it across ``execve`` — else, for this process, ``ru_maxrss`` (None for another)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            found = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M)
        if found:
            return int(found.group(1)) / 1024
    except OSError:
        pass
    if pid != "self":
        return None
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, KiB elsewhere
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def available_bytes() -> int | None:
    """Memory a new allocation can take without swapping or being killed: the kernel's ``MemAvailable``, or less where
    this process's cgroup (a container) has a lower limit left; None where neither is known."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    left = cgroup_memory_left()
    if left is not None:
        found.append(left)
    return min(found) if found else None


def cgroup_memory_left() -> int | None:
    """Bytes this process's memory cgroup may still charge (its limit less its usage), None without a limit."""
    try:
        with open("/proc/self/cgroup") as f:
            groups = f.read().splitlines()
    except OSError:
        return None
    for line in groups:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":  # cgroup v2
            base = os.path.join("/sys/fs/cgroup", parts[2].lstrip("/"))
            files = ("memory.max", "memory.current")
        elif "memory" in parts[1].split(","):  # cgroup v1
            base = os.path.join("/sys/fs/cgroup/memory", parts[2].lstrip("/"))
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        mount = "/sys/fs/cgroup" if files[0] == "memory.max" else "/sys/fs/cgroup/memory"
        for directory in dict.fromkeys((base, os.path.dirname(base.rstrip("/")), mount)):  # (a container: its root)
            try:
                with open(os.path.join(directory, files[0])) as f:
                    limit = f.read().strip()
                with open(os.path.join(directory, files[1])) as f:
                    usage = int(f.read().strip())
            except (OSError, ValueError):
                continue
            if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
                return None
            return max(0, int(limit) - usage)
    return None


def _libc() -> ctypes.CDLL | None:
    """The C library this process runs on, opened once (None where it cannot be)."""
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _advise(address: int, length: int, advice: int = _MADV_HUGEPAGE) -> bool:
    if not sys.platform.startswith("linux") or length <= 0 or _libc() is None:
        return False
    return _libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice) == 0


def whole_pages(start: int, nbytes: int) -> tuple[int, int]:
    """``(first, end)`` of the pages wholly inside the ``nbytes`` bytes from ``start`` (``end <= first``: none)."""
    page = mmap.PAGESIZE
    return -(-start // page) * page, (start + nbytes) // page * page


def huge_page_empty(nbytes: int, on_free=None) -> torch.Tensor:
    """An uninitialized uint8 tensor of ``nbytes``, starting on a 2 MiB boundary, whose pages are asked to be huge
    (they become so when first written). The slack that aligns it is address space only, never touched.
    ``on_free()`` (where given) is called once its memory is let go, with its last view."""
    import torch

    if type(nbytes) is not int or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
    pages = -(-nbytes // HUGE_PAGE) * HUGE_PAGE  # advised whole, so the allocation must hold them all
    if sys.platform.startswith("linux") and nbytes:
        # a mapping of its own, untouched: what torch.empty returns may be heap memory already resident in 4 KiB
        # pages (glibc serves blocks up to 32 MiB from the heap once such a block was freed), which advice leaves
        # as it is. The tensor keeps the mapping alive; it is unmapped with the last view.
        mapping = mmap.mmap(-1, pages + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = torch.frombuffer(mapping, dtype=torch.uint8)
        if on_free is not None:
            weakref.finalize(mapping, on_free)
    else:
        base = torch.empty(pages + HUGE_PAGE, dtype=torch.uint8)
    start = -base.data_ptr() % HUGE_PAGE
    _advise(base.data_ptr() + start, pages)
    return base[start:start + nbytes]


def huge_page_full(shape, value, dtype) -> torch.Tensor:
    """``torch.full(shape, value, dtype=dtype)`` in huge pages (the read probes, as the weights lie)."""
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    t = huge_page_empty(math.prod(shape) * itemsize).view(dtype).view(shape)
    if value == 0 and math.copysign(1.0, value) > 0 and sys.platform.startswith("linux"):
        return t  # a fresh anonymous mapping reads as zeros: its pages stay untouched (no time, no RSS) until written
    return t.fill_(value)


def fresh_zeros_array(shape, dtype) -> np.ndarray:
    """Zeros in a fresh anonymous mapping of ordinary pages, each untouched (no time, no memory) until first written:
    the KV cache and a recipe's scratch. Not huge pages (numpy asks for them from a few MiB on): a first write to one
    may wait for the kernel to compact memory into it, and a short prompt would have one zeroed for every layer's
    and head's first positions (docs/decisions.md, "The KV cache in ordinary pages")."""
    import numpy as np

    count = math.prod(shape)
    if count == 0:
        return np.zeros(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, count * np.dtype(dtype).itemsize), dtype).reshape(shape)


def fresh_zeros(shape, dtype) -> torch.Tensor:
    """``fresh_zeros_array`` as a torch tensor of ``dtype``."""
    import torch

    if math.prod(shape) == 0:
        return torch.zeros(shape, dtype=dtype)
    raw = fresh_zeros_array((math.prod(shape) * torch.empty((), dtype=dtype).element_size(),), "uint8")
    return torch.from_numpy(raw).view(dtype).view(shape)


def huge_page_copies(tensors, n: int) -> list[tuple]:
    """``n`` copies of the tuple ``tensors`` (None entries stay None), laid one after another in one huge-page
    arena as a model's weights lie: cycling through enough of them streams them from DRAM (cold timing)."""
    if type(n) is not int or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    sizes = [0 if t is None else -(-t.nbytes // ALIGN) * ALIGN for t in tensors]
    arena, at, copies = huge_page_empty(n * sum(sizes)), 0, []
    for _ in range(n):
        copy = []
        for t, size in zip(tensors, sizes):
            copy.append(None if t is None else _copy_into(arena[at:at + t.nbytes], t))
            at += size
        copies.append(tuple(copy))
    return copies


def _copy_into(raw: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into the uint8 tensor ``raw`` of exactly its bytes, as a tensor of its dtype and shape."""
    return raw.view(t.dtype).view(t.shape).copy_(t)


_MAPPED: dict[int, int] = {}  # start → end of each live ``mapped_file`` mapping


def mapped_file(fd: int, size: int) -> torch.Tensor:
    """The ``size`` bytes of the open file ``fd`` as a uint8 tensor over a private mapping of it: its pages are the
    page cache's until written (reads share them with every process mapping the file; a write would copy a page,
    never change the file). Tensors viewing it stay where they are when an arena gathers (``gather_into_arena``).
    The mapping lives as long as the last view of it."""
    import torch

    mapping = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    data = torch.frombuffer(mapping, dtype=torch.uint8)  # (holds the mapping until its last view is gone)
    start = data.data_ptr()
    _MAPPED[start] = start + size
    weakref.finalize(mapping, _MAPPED.pop, start, None)
    return data


def read_file(f, size: int, path: str) -> torch.Tensor:
    """The ``size`` bytes of the open file ``f`` read into memory of this process's own (huge pages, as the packed
    weights), for a run that must not depend on the file staying as it is (``--no-mmap``): a file truncated or
    replaced in place while mapped kills its reader with SIGBUS; read, it is only a file. A file changed while it
    is read (shorter than it was, or written meanwhile) is refused naming it."""
    from tmac.base.errors import ModelFormatError

    before = os.fstat(f.fileno())
    data = huge_page_empty(size)
    view, done = memoryview(data.numpy()), 0
    f.seek(0)
    while done < size:
        n = f.readinto(view[done:])
        if not n:
            break
        done += n
    after = os.fstat(f.fileno())
    if done < size or (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        raise ModelFormatError(f"{path}: the file changed while it was read ({done} of {size} bytes read; "
                               f"now {after.st_size} bytes): read it again once it is written")
    return data


def _in_mapped_file(t: torch.Tensor) -> bool:
    at = t.data_ptr()
    return any(start <= at < end for start, end in _MAPPED.items())


_MADV_DONTNEED = 4  # <sys/mman.h>


def release_read_pages(t: torch.Tensor) -> None:
    """Drop from this process the pages wholly inside ``t`` where ``t`` views a ``mapped_file``: read once (a check),
    they need not stay resident; the page cache keeps them, and a later read maps them again. Elsewhere (memory
    of this process's own, not Linux) nothing to do."""
    if t.numel() and _in_mapped_file(t):
        start, end = whole_pages(t.data_ptr(), t.nbytes)
        _advise(start, end - start, _MADV_DONTNEED)


class PackingArena:
    """Huge-page memory that a model's packed tensors are made in as they are packed, each thread's one after
    another in chunks of its own (a loader's thread builds a layer at a time, so a layer's tensors lie together in
    the order it packs them). What ``gather_into_arena`` would do afterwards, without writing every small tensor
    a second time into fresh pages (docs/decisions.md). A chunk's unused tail is address space, never touched."""

    CHUNK = 256 << 20

    def __init__(self):
        self._threads = threading.local()

    def empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` uninitialized bytes (a uint8 tensor) starting on an ``ALIGN`` boundary."""
        mine = self._threads
        at = -(-getattr(mine, "at", 0) // ALIGN) * ALIGN
        chunk = getattr(mine, "chunk", None)
        if chunk is None or at + nbytes > chunk.nbytes:
            key = object()  # (the chunk's address is only known once it is mapped)
            chunk = mine.chunk = huge_page_empty(max(self.CHUNK, -(-nbytes // HUGE_PAGE) * HUGE_PAGE),
                                                 on_free=lambda: _ARENAS.pop(key, None))
            _ARENAS[key] = (chunk.data_ptr(), chunk.data_ptr() + chunk.nbytes)
            at = 0
        mine.at = at + nbytes
        return chunk[at:at + nbytes]


_ARENAS: dict[object, tuple[int, int]] = {}  # (start, end) of each live ``PackingArena`` chunk
_PACKING: PackingArena | None = None  # where ``packed_empty`` makes tensors while a model loads
_LOADING = [0, threading.Lock()]  # loads inside ``packing_into_arena`` now; guards it and ``_PACKING``


@contextlib.contextmanager
def packing_into_arena():
    """``packed_empty`` makes its arrays in one ``PackingArena`` (from any thread) until the block ends. Loads at
    the same time (a server's threads) share it, each thread in chunks of its own; the last one out lets it go."""
    global _PACKING
    with _LOADING[1]:
        if not _LOADING[0]:
            _PACKING = PackingArena()
        _LOADING[0] += 1
    try:
        yield
    finally:
        with _LOADING[1]:
            _LOADING[0] -= 1
            if not _LOADING[0]:
                _PACKING = None


def packed_empty(shape: tuple[int, ...], dtype="uint8") -> np.ndarray:
    """An uninitialized array for packed weights or their parameters: in the arena of a loading model
    (``packing_into_arena``); else from ``IN_PLACE_BYTES`` on in huge pages of its own (the arena leaves it where
    it is), below that from the heap (to be gathered)."""
    import numpy as np

    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    arena = _PACKING
    if arena is not None:
        return arena.empty(nbytes).numpy().view(dtype).reshape(shape)
    if nbytes < IN_PLACE_BYTES:
        return np.empty(shape, dtype)
    return huge_page_empty(nbytes).numpy().view(dtype).reshape(shape)


def _in_packing_arena(t: torch.Tensor) -> bool:
    at = t.data_ptr()
    return any(start <= at < end for start, end in list(_ARENAS.values()))


def _in_place(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``packed_empty`` allocation of its own huge pages: large and starting on a 2 MiB boundary,
    which heap blocks never do (their header comes first); a tensor taken for one by chance would only miss the
    arena."""
    return t.nbytes >= IN_PLACE_BYTES and t.data_ptr() % HUGE_PAGE == 0


def gather_into_arena(owners: list[tuple[object, str]]) -> None:
    """Move the tensors ``getattr(owner, name)`` into one huge-page arena, in the given order (a model's: the order
    a forward pass reads them). Each old tensor is dropped as its copy lands, so memory peaks at about one tensor
    above the total; a tensor several owners share stays shared; one made in huge pages of its own
    (``packed_empty``), made in a ``PackingArena`` or viewing a mapped file (``mapped_file``) stays where it is."""
    owners = [(m, n) for m, n in owners
              if not (_in_place(t := getattr(m, n)) or _in_mapped_file(t) or _in_packing_arena(t))]
    sizes = {id(getattr(m, n)): -(-getattr(m, n).nbytes // ALIGN) * ALIGN for m, n in owners}
    release_freed_memory()  # what the loader freed (its last tensor's temporaries) goes back before the arena grows
    if not sizes:
        return
    arena, at, moved, untrimmed = huge_page_empty(sum(sizes.values())), 0, {}, 0
    for m, name in owners:
        t = getattr(m, name)
        if id(t) not in moved:
            moved[id(t)] = _copy_into(arena[at:at + t.nbytes], t)
            at += sizes[id(t)]
            untrimmed += t.nbytes
        setattr(m, name, moved[id(t)])
        del t
        if untrimmed > TRIM_EVERY:  # the dropped tensors' memory back to the OS as the copies land
            release_freed_memory()
            untrimmed = 0
    release_freed_memory()


_M_ARENA_MAX = -8  # <malloc.h>


def one_malloc_arena() -> None:
    """Have every thread of this process allocate from glibc's one main heap. glibc gives each thread that
    allocates beside another an arena of its own, whose memory stays with it: 6 MiB of a 2-thread run's peak, for
    nothing — the kernels allocate nothing per call, and the rest is Python's, one thread at a time. For the
    command line, whose process is tmac's; a library leaves its host's allocator alone. Elsewhere (no glibc)
    nothing to do."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is not None:
        mallopt(_M_ARENA_MAX, 1)


def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS. glibc keeps it otherwise: once a large block has been freed, blocks
    up to its size (up to 32 MiB) come from the heap, where freed space is reused but not returned — a loader's
    temporaries and the tensors it replaced would stay resident (1B Q4_0: 400 MiB above the model while it is
    gathered). Elsewhere (no glibc) nothing to do."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
