"""What is checked of a compiled kernel library before the dynamic loader maps it into the process.

The loader trusts the file: a segment past the end of the file dies by SIGBUS on first touch, a dynamic section
pointing outside the mapped segments by SIGSEGV inside ``dlopen``. So a library is loaded only when it is a regular
file holding a little-endian 64-bit ELF shared object for the expected machine whose segments lie inside the file
and whose dynamic section, and the tables it names, lie inside what is mapped. What those tables hold (relocations,
symbols) and the code are the library's content: the sha256 recorded beside it (a cache sidecar, a kernel
directory's manifest) vouches for them. A library re-signed by the one who owns the cache is trusted as their own,
like any library they build: nothing short of running it in another process could vet its code.
"""

from __future__ import annotations

import os
import stat
import struct

from tmac.base.errors import KernelUnavailableError

MACHINES = {"x86_64": 62, "arm64": 183}  # e_machine: EM_X86_64, EM_AARCH64
PT_LOAD, PT_DYNAMIC, PT_GNU_RELRO = 1, 2, 0x6474E552
PF_X, PF_W, PF_R = 1, 2, 4
MAX_SEGMENT = 1 << 30  # bytes of memory one segment may ask for (kernel libraries are well under a MiB)
# dynamic tags whose value is an address in the mapped image, and the size tag that goes with some of them
ADDRESS_TAGS = {3: "PLTGOT", 4: "HASH", 5: "STRTAB", 6: "SYMTAB", 7: "RELA", 12: "INIT", 13: "FINI", 17: "REL",
                23: "JMPREL", 25: "INIT_ARRAY", 26: "FINI_ARRAY", 0x6FFFFEF5: "GNU_HASH", 0x6FFFFFF0: "VERSYM",
                0x6FFFFFFC: "VERDEF", 0x6FFFFFFE: "VERNEED"}
SIZE_OF = {5: 10, 7: 8, 23: 2, 25: 27, 26: 28, 17: 18}  # STRTAB→STRSZ, RELA→RELASZ, JMPREL→PLTRELSZ, …
ENTRY_SIZES = {11: 24, 9: 24}  # SYMENT, RELAENT: Elf64_Sym and Elf64_Rela


def check_library(path: str, arch: str, size: int | None = None) -> None:
    """Raise ``KernelUnavailableError`` naming ``path`` unless it is a sound ELF shared object for ``arch`` (of
    ``size`` bytes when given), as above."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise KernelUnavailableError(f"{path}: not a regular file")
        if st.st_size > 64 * MAX_SEGMENT:
            raise KernelUnavailableError(f"{path}: {st.st_size} bytes is not a kernel library")
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise KernelUnavailableError(f"{path}: cannot read ({e.strerror})") from None
    if size is not None and len(data) != size:
        raise KernelUnavailableError(f"{path}: {len(data)} bytes, its manifest says {size}")
    try:
        _check_image(data, arch)
    except ValueError as e:
        raise KernelUnavailableError(f"{path}: {e}") from None


def _check_image(data: bytes, arch: str) -> None:
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    e_type, e_machine = struct.unpack_from("<HH", data, 16)
    if e_type != 3 or e_machine != MACHINES[arch]:
        raise ValueError(f"ELF type {e_type} for machine {e_machine}, not a shared object for {arch} (type 3, "
                         f"machine {MACHINES[arch]})")
    (phoff,), (phentsize, phnum) = struct.unpack_from("<Q", data, 32), struct.unpack_from("<HH", data, 54)
    if phentsize != 56 or not 0 < phnum <= 64 or phoff + phnum * 56 > len(data):
        raise ValueError("its ELF program headers lie outside the file")
    loads, dynamic, relro = [], None, None
    for i in range(phnum):
        p_type, flags, offset, vaddr, _, filesz, memsz, align = struct.unpack_from("<IIQQQQQQ", data, phoff + i * 56)
        if p_type == PT_GNU_RELRO:
            relro = (vaddr, memsz)
        if p_type == PT_LOAD:
            if offset + filesz > len(data):
                raise ValueError(f"segment {i} ends at byte {offset + filesz}, past the file's {len(data)} (truncated)")
            if filesz > memsz or memsz > MAX_SEGMENT or align & (align - 1) or align and (vaddr - offset) % align:
                raise ValueError(f"segment {i} is malformed (file {filesz}, memory {memsz} bytes, align {align})")
            if flags & ~7 or not flags & PF_R or flags & PF_W and flags & PF_X:  # (what linkers write: R, RX, RW)
                raise ValueError(f"segment {i} has permissions {flags:#x}, not R, R+X or R+W")
            loads.append((vaddr, memsz, offset, filesz, flags))
        elif p_type == PT_DYNAMIC:
            dynamic = (offset, vaddr, filesz)
    if not loads or dynamic is None:
        raise ValueError("no loadable segment or no dynamic section: not a shared library")
    # the loader maps each segment at its address from the first one's: they must come in order and not overlap,
    # or a later mapping lands over an earlier one's (relocated) pages
    for (start, memsz, *_), (following, *_) in zip(loads, loads[1:]):
        if start + memsz > following or start >= following:
            raise ValueError("its loadable segments overlap or are out of order")
    if loads[-1][0] + loads[-1][1] - loads[0][0] > MAX_SEGMENT:
        raise ValueError("its segments span more than a kernel library can")
    if not any(f & PF_X for *_, f in loads):
        raise ValueError("no executable segment")
    if not any(f & PF_W and s <= dynamic[1] and dynamic[1] + dynamic[2] <= s + m for s, m, _, _, f in loads):
        raise ValueError("its dynamic section is not in a writable segment (where relocations are written)")
    if relro is not None and not any(f & PF_W and s <= relro[0] and relro[0] + relro[1] <= s + m
                                     for s, m, _, _, f in loads):  # (made read-only after relocation)
        raise ValueError("its read-only-after-relocation range is not inside one writable segment")
    _check_dynamic(data, [load[:4] for load in loads], *dynamic)


def _file_range(loads, vaddr: int, length: int) -> tuple[int, int] | None:
    """The file offsets of ``length`` bytes at address ``vaddr`` if they lie in one segment's file-backed part."""
    for start, _, offset, filesz in loads:
        if start <= vaddr and vaddr + length <= start + filesz:
            return offset + vaddr - start, offset + vaddr - start + length
    return None


def _check_dynamic(data: bytes, loads, offset: int, vaddr: int, filesz: int) -> None:
    where = _file_range(loads, vaddr, filesz)
    if where is None or where[0] != offset or filesz % 16 or offset + filesz > len(data):
        raise ValueError("its dynamic section does not lie in a loaded segment")
    tags: dict[int, int] = {}
    needed = []
    for pos in range(offset, offset + filesz, 16):
        tag, value = struct.unpack_from("<qQ", data, pos)
        if tag == 0:
            break
        if tag == 1:
            needed.append(value)
        tags.setdefault(tag, value)
    else:
        raise ValueError("its dynamic section has no end (DT_NULL)")
    for tag, name in ADDRESS_TAGS.items():
        if tag in tags:
            length = tags.get(SIZE_OF.get(tag, -1), 1)
            if length > MAX_SEGMENT or _file_range(loads, tags[tag], max(1, length)) is None:
                raise ValueError(f"its dynamic entry {name} points outside the loaded segments")
    for tag, size in ENTRY_SIZES.items():
        if tag in tags and tags[tag] != size:
            raise ValueError(f"its dynamic entry {tag} says {tags[tag]}-byte entries, not {size}")
    if 5 not in tags or 6 not in tags:
        raise ValueError("its dynamic section names no string or symbol table")
    if any(n >= tags.get(10, 0) for n in needed):
        raise ValueError("a library it needs is named outside its string table")
