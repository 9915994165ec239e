"""A strict GGUF (v2/v3) reader over a memory map: metadata as plain Python values, tensors as byte views.

Written for hostile files: every count, length and offset is checked against the bytes that remain before
anything is allocated from it, so a malformed file raises ``ModelFormatError`` naming the file and the field,
in time and memory bounded by the file's size. (``gguf.GGUFReader`` also builds a NumPy object per metadata
element, slow on a large vocabulary: docs/decisions.md, "GGUF reader".)
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from tmac.base import files
from tmac.base.errors import ModelFormatError
from tmac.base.memory import read_file, whole_pages

MAGIC = b"GGUF"
# value type → (struct code, size); 8 = string, 9 = array
SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
           7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
         12: "<f8"}
STRING, ARRAY = 8, 9
MAX_DIMS = 4
MAX_ELEMENTS = 1 << 40
MAX_STRINGS = 1 << 22  # the largest vocabulary models/family/llama.py accepts


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str  # GGML type, e.g. "Q4_1", "F32"
    shape: tuple[int, ...]  # numpy order: rows first (GGUF's ne reversed)
    data: np.ndarray  # uint8 view of the tensor's bytes
    offset: int  # of those bytes in the file


# ggml's tensor types (the GGUF spec's ``ggml_type``): id → (name, elements a block, bytes a block). The gguf
# package has them too, but importing it costs 4 MiB of memory; ids it knows and this table does not are looked
# up there.
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
              7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84),
              11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
              15: ("Q8_K", 256, 292), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
              28: ("F64", 1, 8), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66)}


def ggml_type_row(type_id: int) -> tuple[str, int, int] | None:
    """(name, elements a block, bytes a block) of ggml type ``type_id``; None for an id no one knows."""
    if type_id in GGML_TYPES:
        return GGML_TYPES[type_id]
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        return None
    return (qtype.name, *GGML_QUANT_SIZES[qtype])


def projection_types(tensors: dict) -> str | None:
    """A GGUF's projections' quantization in one word: its type (``Q4_1``), a mix's types joined (``Q4_K+Q6_K``);
    None where they are float."""
    types = sorted({t.type_name for name, t in tensors.items() if name.startswith("blk.") and len(t.shape) == 2})
    return "+".join(t for t in types if t not in ("F32", "F16", "BF16")) or None


class GGUFFile:
    def __init__(self, path: str, mapped: bool = True):
        """``mapped=False``: the file read into memory, not mapped (``tmac.base.memory.read_file``)."""
        self.path = path
        with open(files.require_regular(path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise self._error("header", f"file is {size} bytes, shorter than a GGUF header")
            if mapped:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            else:
                self._map = None
                self._read = read_file(f, size, path)  # (held: the tensors view it)
        self._buf = memoryview(self._map) if mapped else memoryview(self._read.numpy())
        self._pos = 0
        if bytes(self._take(4, "magic")) != MAGIC:
            raise self._error("magic", "not a GGUF file (bad magic)")
        self.version = self._scalar(4, "version")
        if self.version not in (2, 3):
            raise self._error("version", f"GGUF version {self.version} is not supported (2 and 3 are)")
        n_tensors = self._count(self._scalar(10, "tensor_count"), 24, "tensor_count")
        n_kv = self._count(self._scalar(10, "kv_count"), 12, "kv_count")
        self.metadata: dict[str, object] = {}
        for i in range(n_kv):
            key = self._string(f"metadata key #{i}")
            self.metadata[key] = self._value(self._scalar(4, f"type of {key}"), key)
        infos = []
        for i in range(n_tensors):
            name = self._string(f"tensor #{i} name")
            n_dims = self._scalar(4, f"tensor {name} n_dims")
            if not 1 <= n_dims <= MAX_DIMS:
                raise self._error(f"tensor {name}", f"n_dims={n_dims} (1..{MAX_DIMS} allowed)")
            ne = [self._scalar(10, f"tensor {name} dims") for _ in range(n_dims)]
            ggml_type = self._scalar(4, f"tensor {name} type")
            offset = self._scalar(10, f"tensor {name} offset")
            infos.append((name, ne, ggml_type, offset))
        alignment = self.metadata.get("general.alignment", 32)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise self._error("general.alignment", f"{alignment!r} is not a power of two")
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, ne, ggml_type, offset in infos:
            self.tensors[name] = self._tensor(name, ne, ggml_type, data_start + offset)

    # ---- primitives, each checked against the bytes left ------------------------------------------------------
    def _error(self, field: str, problem: str) -> ModelFormatError:
        return ModelFormatError(f"{self.path}: GGUF {field}: {problem}")

    def _take(self, n: int, field: str) -> memoryview:
        if n < 0 or self._pos + n > len(self._buf):
            raise self._error(field, f"needs {n} bytes at offset {self._pos}, past the end of the file "
                                     f"({len(self._buf)} bytes; truncated?)")
        view = self._buf[self._pos:self._pos + n]
        self._pos += n
        return view

    def _scalar(self, vtype: int, field: str):
        code, size = SCALARS[vtype]
        return struct.unpack(code, self._take(size, field))[0]

    def _count(self, n: int, min_bytes: int, field: str) -> int:
        if n * min_bytes > len(self._buf) - self._pos:
            raise self._error(field, f"{n} entries cannot fit in the {len(self._buf) - self._pos} bytes left")
        return n

    def _string(self, field: str) -> str:
        n = self._scalar(10, f"{field} length")
        raw = self._take(n, field)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise self._error(field, "not valid UTF-8") from None

    def _strings(self, n: int, key: str) -> list[str]:
        """``n`` strings in a row (a vocabulary, its merges: 100k and more): ``_string``'s checks in one loop."""
        buf, pos, end, out = self._buf, self._pos, len(self._buf), []
        length = struct.Struct("<Q").unpack_from
        for i in range(n):
            if pos + 8 > end:
                self._pos = pos
                self._take(8, f"{key}[{i}] length")  # (raises, naming the entry)
            size = length(buf, pos)[0]
            if pos + 8 + size > end:
                self._pos = pos + 8
                self._take(size, f"{key}[{i}]")
            try:
                out.append(str(buf[pos + 8:pos + 8 + size], "utf-8"))
            except UnicodeDecodeError:
                raise self._error(f"{key}[{i}]", "not valid UTF-8") from None
            pos += 8 + size
        self._pos = pos
        return out

    def _value(self, vtype: int, key: str):
        if vtype in SCALARS:
            return self._scalar(vtype, key)
        if vtype == STRING:
            return self._string(key)
        if vtype != ARRAY:
            raise self._error(key, f"unknown value type {vtype}")
        etype = self._scalar(4, f"{key} element type")
        n = self._scalar(10, f"{key} length")
        if etype in SCALARS:
            size = SCALARS[etype][1]
            self._count(n, size, f"{key} length")
            values = np.frombuffer(self._take(n * size, key), dtype=NUMPY[etype])
            return values.astype(bool).tolist() if etype == 7 else values.tolist()
        if etype == STRING:
            self._count(n, 8, f"{key} length")
            if n > MAX_STRINGS:  # (a vocabulary, the largest string array a model has: refused before it is read)
                raise self._error(key, f"{n} strings; tmac reads at most {MAX_STRINGS} (a vocabulary of "
                                       f"{MAX_STRINGS} tokens, or as many merges)")
            return self._strings(n, key)
        raise self._error(key, f"arrays of type {etype} are not supported")

    def _tensor(self, name: str, ne: list[int], ggml_type: int, start: int) -> GGUFTensor:
        found = ggml_type_row(ggml_type)
        if found is None:
            raise self._error(f"tensor {name}", f"unknown GGML type {ggml_type}")
        type_name, block, type_size = found
        count = 1
        for d in ne:
            if d <= 0 or count * d > MAX_ELEMENTS:
                raise self._error(f"tensor {name}", f"dims {ne} are not positive or too large")
            count *= d
        if ne[0] % block:
            raise self._error(f"tensor {name}", f"row length {ne[0]} is not a multiple of {type_name}'s block "
                                                f"size {block}")
        nbytes = count // block * type_size
        if start + nbytes > len(self._buf):
            raise self._error(f"tensor {name}", f"data [{start}, {start + nbytes}) lies past the end of the file "
                                                f"({len(self._buf)} bytes)")
        data = np.frombuffer(self._buf, dtype=np.uint8, count=nbytes, offset=start)
        return GGUFTensor(name, type_name, tuple(reversed(ne)), data, start)

    def release(self, tensor: GGUFTensor) -> None:
        """Unmap the pages wholly inside ``tensor``'s bytes from this process once they have been read: a loader
        that converts tensor by tensor would otherwise hold the whole file in its resident memory besides what it
        made of it (1B Q4_0: 630 MiB). They stay in the page cache; reading them again faults them back in."""
        start, end = whole_pages(tensor.offset, tensor.data.nbytes)
        if end > start and self._map is not None and hasattr(mmap, "MADV_DONTNEED"):  # (read, not mapped: kept)
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
