"""A model's decode and prefill plans written down beside its packed copy, so that a later run steps the model
without torch: the run's start-up is then numpy, ``tvm_ffi`` and the mapped file (docs/decisions.md, "Runs that
never import torch").

``write`` (in a run that built the plans, with torch) records each plan's calls: the kernel library and function
of each call, or a copy between two buffers; each tensor argument as a view of a *base* — a tensor of the packed
copy by its name, one of the plan's scratch buffers, the KV cache, or a constant (RoPE tables, biases) whose bytes
the recipe holds — with its byte offset, shape, strides and dtype, written once in a table of views that the calls
index (a plan passes the same few hundred views thousands of times); and how a step embeds its token. ``read`` maps
the packed copy with numpy, checks its layers as loading it with torch would (``layout_checksum``, finite floats),
makes the bases and views, loads the kernels, and gives ``RecordedPlans``, whose plans run exactly the calls the
recorded ones did (``tmac.models.run.calls.CallPlan``) — the same numbers bit for bit.

A recipe is keyed by what its calls depend on: the packed copy it points into (size, time, inode), the code that
builds plans, the kernel generator, the ISA, the CPUs a prefill's attention splits over, the context and the KV
cache's dtype, and the environment variables that change a plan (``TMAC_ISA``, ``TMAC_DOT_ROWS``); any change
misses it, and the run takes the torch path and writes it again. It is trusted as a kernel library in the same
cache is (a file of this user's, in a directory no one else writes), and checked against damage: its bytes'
digest, every view inside its base, every kernel function one its spec has.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import mmap
import os
import struct
import threading
from types import SimpleNamespace

import numpy as np

from tmac.base import files
from tmac.base.errors import ModelFormatError
from tmac.base.memory import fresh_zeros_array
from tmac.models.run.calls import PREFILL_ROWS_KEPT, CallPlan, prefill_rows

VERSION = 2  # 2: views in one table, each argument its index
SUFFIX = ".plans"
# prefill plans written down: a chunk of n prompt tokens runs on the least of them that holds prefill_rows(n) rows
# (a row's numbers do not depend on the rows beside it: docs/decisions.md)
PREFILL_LADDER = (2, 4, 8, 16, 32, 64, 128, 256)
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": None, "int8": np.int8, "uint8": np.uint8,
          "int16": np.int16, "int32": np.int32, "int64": np.int64}
# the modules whose code decides a recipe's calls (found by path: a run from a recipe imports none of the torch ones)
PLAN_MODULES = ("tmac.models.run.decode", "tmac.models.run.calls", "tmac.models.run.recipe", "tmac.base.glue",
                "tmac.execution.lut_ops", "tmac.quant.spec", "tmac.nn.linear")
MAX_RECIPE = 256 << 20  # bytes: a recipe's JSON and constants (RoPE tables of a long context) stay well under


def path_for(copy: str, context: int | None, kv_dtype: str) -> str:
    """Where the recipe of the packed copy ``copy`` for a cache of ``context`` positions (None: the load's default)
    in ``kv_dtype`` lies."""
    return f"{copy.removesuffix('.tmac')}.c{context or 'default'}.{kv_dtype}{SUFFIX}"


def key(copy: str, context: int | None, kv_dtype: str) -> dict:
    """What a recipe's calls depend on (module doc)."""
    from tmac.base.cpu import usable_cpus
    from tmac.kernels import best_isa
    from tmac.quant.cache import generator_digest, source_digest

    st = os.stat(copy)
    code = source_digest([importlib.util.find_spec(name).origin for name in PLAN_MODULES])
    return {"version": VERSION, "copy": [st.st_size, st.st_mtime_ns, st.st_ino], "code": code,
            "generator": generator_digest(),
            "isa": best_isa().name, "cpus": usable_cpus(), "context": context, "kv_dtype": kv_dtype,
            "env": {name: os.environ.get(name, "") for name in ("TMAC_ISA", "TMAC_DOT_ROWS")}}


def _extent(shape, strides, itemsize: int) -> int:
    """Bytes from a view's first element to past its last (strides in elements)."""
    return 0 if 0 in shape else (sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * itemsize


def _name(dtype) -> str:
    """A torch dtype's name as a recipe writes it (numpy's: ``DTYPES``)."""
    return str(dtype).removeprefix("torch.")


# ---- writing (a run with torch, after its plans are built) -----------------------------------------------------

class _Unrecordable(Exception):
    pass


def write(model, plans: list, path: str, recipe_key: dict, multiplies: bool) -> bool:
    """Write ``plans`` (``DecodePlan``s of ``model``: the one-row decode plan, then prefill plans) as the recipe at
    ``path``, atomically; whether it was (a plan whose calls are not all kernels and copies, or whose tensors are not
    all in the copy, its scratch, cache and small constants, is not written down: those runs take torch).
    ``multiplies``: whether a prompt's rows take dot products (one prompt token then takes a prefill plan). The file:
    the JSON's length (8 bytes), the JSON, the constants' bytes, and the SHA-256 of everything before it."""
    try:
        body, blob = _Recorder(model).record(plans)
    except _Unrecordable:
        return False
    body.update(key=recipe_key, multiplies=multiplies, blob_bytes=len(blob))
    text = json.dumps(body, separators=(",", ":")).encode()
    data = struct.pack("<Q", len(text)) + text + blob
    if len(data) > MAX_RECIPE:
        return False

    def put(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data + hashlib.sha256(data).digest())

    files.write_atomically(path, put, "recipe")
    return True


class _Recorder:
    def __init__(self, model):
        import torch

        self.torch = torch
        state = {}
        for name, t in model.state_dict().items():
            if isinstance(t, torch.Tensor) and t.numel() and t.is_contiguous():
                state.setdefault((t.data_ptr(), t.nbytes), name)
        self.state = sorted((ptr, ptr + n, name) for (ptr, n), name in state.items())
        self.caches = [model.cache_k, model.cache_v]
        self.consts: list = []
        self.const_of: dict = {}
        for table in (model.cos, model.sin, model.cos_local, model.sin_local, model.cos_none, model.sin_none):
            if table is not None:
                self._const(table)
        self.scratch: list = []
        self.scratch_of: dict = {}
        self.model = model
        self.functions: dict = {}
        self.written: dict = {}  # id of a function → [its library's index, its name]
        self.libraries: list = []
        self.views: list = []
        self.view_of: dict = {}

    def _const(self, t) -> int:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.const_of:
            self.const_of[ptr] = len(self.consts)
            self.consts.append(t.contiguous())
        return self.const_of[ptr]

    def _base(self, t):
        """(kind, id, base tensor) of the buffer ``t`` views."""
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.scratch_of:
            return "scratch", self.scratch_of[ptr], self.scratch[self.scratch_of[ptr]]
        for i, cache in enumerate(self.caches):
            if cache is not None and ptr == cache.untyped_storage().data_ptr():
                return "cache", i, cache
        if ptr in self.const_of:
            return "const", self.const_of[ptr], self.consts[self.const_of[ptr]]
        at, end = t.data_ptr(), t.data_ptr() + _extent(t.shape, t.stride(), t.element_size())
        for start, stop, name in self.state:  # (few hundred: a scan per tensor is fine at record time)
            if start <= at and end <= stop:
                return "state", name, (start, stop)
        raise _Unrecordable(f"a tensor outside the copy, the scratch, the cache and the constants ({tuple(t.shape)})")

    def ref(self, t) -> int:
        """The index of ``t``'s view in the recipe's table of views."""
        if t.dtype not in (self.torch.float32, self.torch.float16, self.torch.int8, self.torch.uint8,
                           self.torch.int16, self.torch.int32):
            raise _Unrecordable(f"a tensor of dtype {t.dtype}")
        kind, ident, base = self._base(t)
        start = base[0] if kind == "state" else base.data_ptr()
        view = (kind, ident, t.data_ptr() - start, tuple(t.shape), tuple(t.stride()), _name(t.dtype))
        if view not in self.view_of:
            self.view_of[view] = len(self.views)
            self.views.append([*view[:3], list(view[3]), list(view[4]), view[5]])
        return self.view_of[view]

    def arg(self, plan, a) -> list:
        torch = self.torch
        if isinstance(a, bool) or a is None:
            raise _Unrecordable(f"an argument {a!r}")
        if isinstance(a, int):
            return ["i", a]
        if isinstance(a, float):
            return ["f", a]
        if isinstance(a, torch.Tensor):
            return ["t", self.ref(a)]
        t = plan.tensors.get(id(a))
        if t is None:
            raise _Unrecordable(f"an argument of type {type(a).__name__}")
        return ["t", self.ref(t)]

    def function(self, fn) -> list:
        written = self.written.get(id(fn))
        if written is not None:
            return written
        found = self.functions.get(id(fn))
        if found is None:
            raise _Unrecordable("a call of something other than a kernel")
        spec, name, hold = found
        entry = {"kind": "glue" if hasattr(spec, "attend_args") else "lut", "spec": spec.to_dict()
                 if hasattr(spec, "attend_args") else json.loads(spec.to_json()), "hold": hold}
        if entry not in self.libraries:
            self.libraries.append(entry)
        written = self.written[id(fn)] = [self.libraries.index(entry), name]  # (a plan calls each thousands of times)
        return written

    def record(self, plans: list) -> tuple[dict, bytes]:
        from tmac.models.run.decode import plan_functions

        torch = self.torch
        self.functions = plan_functions(self.model, plans)
        for plan in plans:
            for t in plan.scratch:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.scratch_of:
                    self.scratch_of[ptr] = len(self.scratch)
                    self.scratch.append(t)
            for kept in plan._keep[3]:  # the q/k/v biases: constants
                self._const(kept)
        written = []
        for plan in plans:
            calls, index = [], {}
            # an attend call's cache arguments are the last stepped sequence's: written as the plan's own cache
            own = {id(args): plan.own_cache[layer] for row in plan.rows_positions for layer, args in enumerate(row)}
            at_pos, at_keys, at_values = plan.slots
            for fn, args in plan.calls:
                index[id(args)] = len(calls)
                owner = getattr(fn, "__self__", None)
                if isinstance(owner, torch.Tensor) and getattr(fn, "__name__", "") == "copy_":
                    calls.append(["copy", self.ref(owner), self.ref(args[0])])
                    continue
                cache = own.get(id(args))
                if cache is not None:
                    args = list(args)
                    args[at_pos], args[at_keys], args[at_values] = 0, *cache
                calls.append(["call", *self.function(fn), [self.arg(plan, a) for a in args]])
            embeds = []
            for embed in plan.embed_rows:
                recipe = getattr(embed, "recipe", None)
                if recipe is None:
                    raise _Unrecordable("a token table looked up in Python")
                kind, params, x = recipe
                if kind == "row":
                    embeds.append(["row", self.ref(params), self.ref(x)])
                else:
                    glue = plan._keep[0]
                    embeds.append(["embed", *self.function(glue.embed), [self.ref(p) for p in params], self.ref(x)])
            written.append({"rows": plan.rows, "prefill": plan.prefill_plan, "calls": calls,
                            "positions": [[index[id(args)] for args in row] for row in plan.rows_positions],
                            "slots": list(plan.slots), "logits": self.ref(plan.buf["logits"]), "embed": embeds,
                            "vocab": plan.vocab, "context": plan.context,
                            "glue": self.function(plan._keep[0].norm_final)[0]})
        blob, consts = bytearray(), []
        for t in self.consts:
            raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
            consts.append([_name(t.dtype), list(t.shape), len(blob)])
            blob += raw + bytes(-len(raw) % 64)
        body = {"version": VERSION, "libraries": self.libraries, "consts": consts,
                "scratch": [[_name(t.dtype), list(t.shape)] for t in self.scratch],
                "caches": [None if c is None else [_name(c.dtype), list(c.shape)]
                           for c in self.caches],
                "views": self.views, "plans": written}
        return body, bytes(blob)


# ---- reading (a run without torch) -------------------------------------------------------------------------------

class _Damaged(ModelFormatError):
    """A recipe that cannot be used as it is (removed: the run takes torch and writes it again)."""


def _fail(path: str, why: str):
    raise _Damaged(f"{path}: not a usable plan recipe ({why})")


def _bad_copy(path: str, why: str):
    raise ModelFormatError(f"{path}: not a readable packed model ({why})")


def _header(f, size: int, what: str) -> tuple[int, dict]:
    if size < 8:
        _fail(what, "shorter than its header")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > size - 8:
        _fail(what, f"a header of {n} bytes in {size}")
    body = files.parse_json(f.read(n), what)
    if not isinstance(body, dict):
        _fail(what, "the header is not an object")
    return n, body


def _dtype(name, what: str):
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        _fail(what, f"dtype {name!r:.20}")
    return np.dtype(dtype)


def _ints(value, what: str, count: int | None = None) -> list[int]:
    if not isinstance(value, list) or (count is not None and len(value) != count) or \
            not all(type(v) is int and v >= 0 for v in value):
        _fail(what, f"{value!r:.60} is not a list of counts")
    return value


class CopyTensors:
    """The tensors of a packed copy (a ``.tmac`` file), mapped with numpy: its safetensors header and the tmac
    metadata, each tensor's bytes by name (aliases resolved), checked as ``tmac.nn.serialize.read_state`` checks
    them (offsets inside the file, finite floats) and its layers as ``tmac.Linear`` loading them does
    (``layout_checksum``)."""

    SAFE_DTYPES = {"F32": np.float32, "F16": np.float16, "I8": np.int8, "U8": np.uint8, "I16": np.int16,
                   "I32": np.int32, "I64": np.int64, "BF16": None, "F64": np.float64, "BOOL": np.bool_}

    def __init__(self, path: str):
        self.path = path
        with open(files.require_regular(path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n, header = _header(f, size, path)
            self.mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size > 8 + n else None
        self.data = np.frombuffer(self.mapping, np.uint8) if self.mapping is not None else np.empty(0, np.uint8)
        meta = header.get("__metadata__") or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            _bad_copy(path, "__metadata__ is not an object of strings")
        self.info = files.parse_json(meta.get("tmac", "{}"), "its tmac metadata")
        self.model_info = files.parse_json(meta.get("tmac_model", "null"), "its tmac_model metadata")
        if not isinstance(self.info, dict) or not isinstance(self.model_info, dict):
            _bad_copy(path, "no tmac model metadata")
        self.tensors: dict[str, np.ndarray] = {}
        for name, entry in header.items():
            if name == "__metadata__" or name.startswith("tmac:pad:"):
                continue
            if not isinstance(entry, dict) or entry.get("dtype") not in self.SAFE_DTYPES:
                _bad_copy(path, f"tensor {name!r:.60}: dtype {entry!r:.40}")
            dtype = self.SAFE_DTYPES[entry["dtype"]]
            shape, offsets = _ints(entry.get("shape"), path), _ints(entry.get("data_offsets"), path, 2)
            nbytes = math.prod(shape) * (np.dtype(dtype).itemsize if dtype is not None else 2)
            start, end = offsets
            if end != start + nbytes or 8 + n + end > size:
                _bad_copy(path, f"tensor {name!r:.60}: bytes {start}..{end} for shape {shape}, or past the end")
            raw = self.data[8 + n + start:8 + n + end]
            self.tensors[name] = raw if dtype is None else raw.view(dtype).reshape(shape)
        aliases = self.info.get("aliases", {})
        if not isinstance(aliases, dict):
            _bad_copy(path, "aliases")
        for name, target in aliases.items():
            if target not in self.tensors:
                _bad_copy(path, f"alias {name!r:.60} of a missing tensor")
            self.tensors[name] = self.tensors[target]

    def check(self, names) -> None:
        """The tensors ``names`` (and the layers they belong to) are as saved: finite floats, and each layer's
        checksum over its spec and packed tensors. Half the layers in a second thread: their checksums and tests are
        zlib's and numpy's, which give the GIL away."""
        extras = self.info.get("extra_state", {})
        extras = extras if isinstance(extras, dict) else {}
        layers = sorted({name.rsplit(".", 1)[0] for name in names if "." in name})
        specs: dict = {}  # (a model's layers share a few specs)
        failed: list = []

        def check_part(part_names, part_layers) -> None:
            stage = 0
            try:
                for name in part_names:
                    if not _finite(self.tensors[name]):
                        raise ModelFormatError(f"{self.path}: tensor {name} contains NaN or inf")
                stage = 1
                for layer in part_layers:
                    self._check_layer(layer, extras.get(f"{layer}._extra_state"), specs)
            except BaseException as e:  # (raised in the caller's thread)
                failed.append((stage, e))

        names = sorted(names)
        other = threading.Thread(target=check_part, args=(names[1::2], layers[1::2]), name="tmac-check", daemon=True)
        other.start()
        check_part(names[::2], layers[::2])
        other.join()
        if failed:  # (the same error whichever thread came first: an interrupt, a tensor's, then a layer's)
            raise min(failed, key=lambda f: (isinstance(f[1], Exception), f[0]))[1]

    def _check_layer(self, layer: str, extra, specs: dict) -> None:
        from tmac.execution.packing import layout_checksum
        from tmac.quant.spec import KernelSpec

        if not isinstance(extra, dict) or "spec" not in extra:
            return
        spec_key = json.dumps(extra["spec"], sort_keys=True)
        if spec_key not in specs:
            try:
                specs[spec_key] = KernelSpec.from_dict(extra["spec"])
            except (ValueError, TypeError) as e:
                raise ModelFormatError(f"{self.path}: layer {layer}: {e}") from None
        crc = layout_checksum(specs[spec_key], *(self.tensors.get(f"{layer}.{part}")
                                                 for part in ("qweight", "scales", "zeros")))
        if extra.get("checksum") != crc:
            raise ModelFormatError(f"{self.path}: the packed weights of layer {layer} do not match their kernel "
                                   f"spec and checksum: the file is damaged")


def _finite(t: np.ndarray) -> bool:
    """No NaN or infinity in ``t``; float16's by its exponent bits (numpy's ``isfinite`` takes it through float32, a
    few times slower)."""
    if t.dtype.kind != "f":
        return True
    if t.dtype == np.float16:
        return t.size == 0 or int(np.bitwise_and(t.view(np.uint16), 0x7C00).max()) != 0x7C00
    return bool(np.isfinite(t).all())


class RecordedPlan(CallPlan):
    """A plan read back from a recipe: the recorded calls on this process's views and kernels."""

    def __init__(self, entry: dict, views, functions, labels: dict, glue_spec, what: str):
        self.rows = entry["rows"]
        self.glue_spec, self.labels = glue_spec, labels
        self.context, self.vocab = entry["context"], entry["vocab"]
        calls = []
        for call in entry["calls"]:
            if not isinstance(call, list) or not call:
                _fail(what, "a call")
            if call[0] == "copy" and len(call) == 3:
                dst, src = views(call[1], raw=True), views(call[2], raw=True)
                if dst.shape != src.shape:
                    _fail(what, "a copy between views of two shapes")
                calls.append((_copier(dst), [src]))
            elif call[0] == "call" and len(call) == 4 and isinstance(call[3], list):
                fn = functions(call[1], call[2])
                calls.append((fn, [_arg(a, views, what) for a in call[3]]))
            else:
                _fail(what, f"a call {call!r:.60}")
        self.calls = calls
        positions = entry["positions"]
        if not isinstance(positions, list) or len(positions) != self.rows:
            _fail(what, "positions")
        self.rows_positions = [[calls[_index(i, len(calls), what)][1] for i in row] for row in positions]
        self.slots = tuple(_ints(entry["slots"], what, 3))
        for row in self.rows_positions:
            for args in row:
                if max(self.slots) >= len(args):
                    _fail(what, "slots")
        self.own_cache = [(args[self.slots[1]], args[self.slots[2]]) for args in self.rows_positions[0]]
        logits = views(entry["logits"], raw=True)
        self.buf = {"logits": logits}
        if not isinstance(entry["embed"], list) or len(entry["embed"]) != self.rows:
            _fail(what, "embed")
        self.embed_rows = [_embedder(e, views, functions, what) for e in entry["embed"]]
        self.prefill_plan = bool(entry["prefill"])

    def sequence_handles(self, sequence) -> list[tuple]:
        return self.own_cache  # (one sequence: the recipe's cache)


def _index(i, n: int, what: str) -> int:
    if type(i) is not int or not 0 <= i < n:
        _fail(what, f"call index {i!r:.20}")
    return i


def _arg(a, views, what: str):
    if not isinstance(a, list) or len(a) != 2:
        _fail(what, f"argument {a!r:.40}")
    kind, value = a
    if kind == "t":
        return views(value)
    if kind == "i" and type(value) is int:
        return value
    if kind == "f" and type(value) in (int, float):
        return float(value)
    _fail(what, f"argument {a!r:.40}")


def _copier(dst: np.ndarray):
    def copy(src: np.ndarray) -> None:
        np.copyto(dst, src)
    return copy


def _embedder(entry, views, functions, what: str):
    if not isinstance(entry, list) or not entry:
        _fail(what, "an embedding")
    if entry[0] == "row" and len(entry) == 3:
        table, x = views(entry[1], raw=True), views(entry[2], raw=True)
        if table.ndim != 2 or x.shape != table.shape[1:]:
            _fail(what, "a token table's row")
        return lambda t: np.copyto(x, table[t])
    if entry[0] == "embed" and len(entry) == 5 and isinstance(entry[3], list):
        fn = functions(entry[1], entry[2])
        params, x = [views(p) for p in entry[3]], views(entry[4])
        return lambda t: fn(*params, t, x)
    _fail(what, f"an embedding {entry[0]!r:.20}")


class RecordedPlans:
    """The plans of a recipe, as ``tmac.models.run.decode.Plans`` gives them: ``decode(1)`` and ``prefill(n)``
    (the least written-down prefill plan that holds ``prefill_rows(n)`` rows, made on first need; one token: the
    decode plan, unless a prompt's rows multiply)."""

    def __init__(self, decode: RecordedPlan, prefill: dict, make, multiplies: bool):
        self._decode, self._entries, self._make, self.multiplies = decode, prefill, make, multiplies
        self._prefill: dict = {}

    def current(self) -> "RecordedPlans":
        return self

    def decode(self, rows: int = 1):
        return self._decode if rows == 1 else None

    def prefill(self, tokens: int):
        if tokens == 1 and not self.multiplies:
            return self._decode
        need = prefill_rows(tokens)
        fits = [rows for rows in self._entries if rows >= need]
        if not fits:
            return None
        rows = min(fits)
        plan = self._prefill.pop(rows) if rows in self._prefill else self._make(self._entries[rows])
        self._prefill[rows] = plan  # the most recent last; as many kept as ``Plans`` keeps
        while sum(self._prefill) > max(rows, PREFILL_ROWS_KEPT):
            del self._prefill[next(iter(self._prefill))]
        return plan


class RecordedSequence:
    """The one sequence of a recorded model: the tokens its cache holds (``Sequence``'s part a generation uses)."""

    def __init__(self, context: int, kv_dtype: str):
        self.context, self.kv_dtype = context, kv_dtype
        self.ids: list[int] = []
        self.glue_handles = None

    def current(self, model) -> bool:
        return True


def read(path: str, copy: str, recipe_key: dict):
    """The model a recipe steps: ``SimpleNamespace(config, context, kv_dtype, tokenizer, source, plans, sequence)``,
    or None where the recipe is missing, written under another key, or damaged (then removed: the run takes torch
    and writes it again). A damaged packed copy raises ``ModelFormatError`` as loading it would."""
    try:
        with open(files.require_regular(path), "rb") as f:
            data = f.read(MAX_RECIPE + 33)
        if len(data) > MAX_RECIPE + 32 or len(data) < 40 or hashlib.sha256(data[:-32]).digest() != data[-32:]:
            _fail(path, "its bytes do not match their digest")
        (n,) = struct.unpack("<Q", data[:8])
        body = files.parse_json(data[8:8 + n], path) if 8 + n <= len(data) - 32 else None
        if not isinstance(body, dict):
            _fail(path, "its header")
        if body.get("key") != recipe_key:
            return None
        blob = data[8 + n:-32]
        if len(blob) != body["blob_bytes"]:
            _fail(path, "its constants")
        return _Reader(path, copy, body, blob, recipe_key).model()
    except FileNotFoundError:
        return None
    except (_Damaged, KeyError, TypeError, ValueError, IndexError) as e:
        if isinstance(e, ModelFormatError) and not isinstance(e, _Damaged):
            raise  # (the packed copy's damage: as a load says it)
        try:
            os.unlink(path)
        except OSError:
            pass
        return None


class _Reader:
    def __init__(self, path: str, copy: str, body: dict, blob: bytes, recipe_key: dict):
        self.path, self.body, self.key = path, body, recipe_key
        self.copy = CopyTensors(copy)
        self.consts = []
        for dtype, shape, at in body["consts"]:
            dt = _dtype(dtype, path)
            count = math.prod(_ints(shape, path))
            if type(at) is not int or at < 0 or at + count * dt.itemsize > len(blob):
                _fail(path, "a constant past the end")
            self.consts.append(np.frombuffer(blob, dt, count, at).reshape(shape).copy())
        self.scratch_specs = [(_dtype(d, path), tuple(_ints(s, path))) for d, s in body["scratch"]]
        self.scratch: dict[int, np.ndarray] = {}
        self.caches = [None if c is None else fresh_zeros_array(tuple(_ints(c[1], path)), _dtype(c[0], path))
                       for c in body["caches"]]
        self.libraries = body["libraries"]
        self.views = body["views"]
        if not isinstance(self.views, list):
            _fail(path, "views")
        self.loaded: dict = {}
        self.handles: dict = {}
        self.labels: dict = {}

    def model(self):
        from tmac.models.text.tokenizer import tokenizer_from_info

        info = self.copy.model_info
        config, tok = info.get("config"), info.get("tokenizer")
        if not isinstance(config, dict) or tok is None:
            return None  # (no tokenizer: text needs one, as the torch path says)
        vocab, context_length = config.get("vocab_size"), config.get("context_length")
        if type(vocab) is not int or type(context_length) is not int:
            _fail(self.path, "the copy's config")
        plans = self.body["plans"]
        if not isinstance(plans, list) or not plans or plans[0].get("rows") != 1 or plans[0].get("prefill"):
            _fail(self.path, "no one-row decode plan first")
        decode = self.plan(plans[0])
        prefill = {}
        for entry in plans[1:]:
            rows = entry.get("rows")
            if type(rows) is not int or rows < 2 or not entry.get("prefill"):
                _fail(self.path, "a prefill plan")
            prefill[rows] = entry
        self.copy.check(sorted(self.copy.tensors))  # (every layer: a prefill plan reads what decode does)
        tokenizer = tokenizer_from_info(tok, self.copy.path)
        if type(self.body.get("multiplies")) is not bool:
            _fail(self.path, "multiplies")
        recorded = RecordedPlans(decode, prefill, self.plan, self.body["multiplies"])
        context, kv_dtype = decode.context, self.key["kv_dtype"]
        return SimpleNamespace(config=SimpleNamespace(vocab_size=vocab, context_length=context_length), context=context,
                               kv_dtype=kv_dtype, tokenizer=tokenizer, source=self.copy.path, plans=recorded,
                               sequence=RecordedSequence(context, kv_dtype), packed_copy=self.copy.path,
                               file_quantization=info.get("file_quantization"))

    def plan(self, entry: dict) -> RecordedPlan:
        glue_index = entry["glue"]
        glue_spec = self._spec(glue_index)
        return RecordedPlan(entry, self.view, self.function, self.labels, glue_spec, self.path)

    def _spec(self, index):
        from tmac.base.glue import GlueSpec
        from tmac.quant.spec import KernelSpec

        if type(index) is not int or not 0 <= index < len(self.libraries):
            _fail(self.path, f"library {index!r:.20}")
        entry = self.libraries[index]
        if entry["kind"] == "glue":
            return GlueSpec(**entry["spec"])
        return KernelSpec.from_dict(entry["spec"])

    def function(self, index, name):
        key = (index, name)
        if key not in self.loaded:
            from tmac.execution import runtime
            from tmac.kernels import isa_by_name

            spec = self._spec(index)
            if name not in spec.functions:
                _fail(self.path, f"function {name!r:.40} of {spec.name}")
            lib = runtime.load_kernels(spec, isa_by_name(spec.isa))
            lib = lib.holding_gil if self.libraries[index].get("hold") else lib
            self.loaded[key] = getattr(lib, name)
            self.labels[id(self.loaded[key])] = name
        return self.loaded[key]

    def _base(self, kind, ident) -> np.ndarray:
        if kind == "state":
            t = self.copy.tensors.get(ident) if isinstance(ident, str) else None
            if t is None:
                _fail(self.path, f"a tensor {ident!r:.60} the copy lacks")
            return t
        if kind == "scratch" and type(ident) is int and 0 <= ident < len(self.scratch_specs):
            if ident not in self.scratch:
                dtype, shape = self.scratch_specs[ident]
                self.scratch[ident] = fresh_zeros_array(shape, dtype)
            return self.scratch[ident]
        if kind == "const" and type(ident) is int and 0 <= ident < len(self.consts):
            return self.consts[ident]
        if kind == "cache" and type(ident) is int and 0 <= ident < len(self.caches) and self.caches[ident] is not None:
            return self.caches[ident]
        _fail(self.path, f"a base {kind!r:.20} {ident!r:.40}")

    def view(self, index, raw: bool = False):
        """The array (``raw``) or kernel handle of the recorded view ``index``, checked to lie inside its base."""
        cached = self.handles.get(index) if type(index) is int else None
        if cached is not None:
            return cached[0] if raw else cached[1]
        if type(index) is not int or not 0 <= index < len(self.views):
            _fail(self.path, f"view {index!r:.20}")
        ref = self.views[index]
        if not isinstance(ref, list) or len(ref) != 6:
            _fail(self.path, f"a view {ref!r:.60}")
        kind, ident, offset, shape, strides, dtype = ref
        base = self._base(kind, ident)
        dt = _dtype(dtype, self.path)
        if base.dtype != dt:  # (a view reads its tensor as the tensor is: a file of other bytes is refused)
            _fail(self.path, f"a view of {dtype} into a tensor of {base.dtype}")
        shape, strides = _ints(shape, self.path), _ints(strides, self.path)
        if len(shape) != len(strides) or type(offset) is not int or offset < 0:
            _fail(self.path, f"a view {ref!r:.60}")
        extent = _extent(shape, strides, dt.itemsize)
        raw_base = base.reshape(-1).view(np.uint8)
        if offset + extent > raw_base.nbytes or offset % dt.itemsize:
            _fail(self.path, f"a view past its base {ref!r:.60}")
        array = np.ndarray(shape, dt, raw_base, offset, [s * dt.itemsize for s in strides])
        from tmac.execution import runtime

        handle = runtime.ffi().from_dlpack(array)
        self.handles[index] = (array, handle)
        return array if raw else handle


def record_run(model, session, copy: str, context: int | None, at: str | None = None) -> bool:
    """After a torch run of ``model`` (loaded from, or packed into, the ``.tmac`` file ``copy``, with the ``context``
    option): write the recipe a later run takes — its one-row decode plan and the ``PREFILL_LADDER`` prefill plans —
    named after ``at`` (default: ``copy``), unless one under the same key is there. Whether one is."""
    from tmac.models.run.decode import DecodePlan, multiplies

    if any(getattr(m, "repacked", False) for m in model.modules()):
        return False  # (a file packed for another CPU, repacked as it loaded: its bytes are not what runs)
    path = path_for(at or copy, context, model.kv_dtype)
    recipe_key = key(copy, context, model.kv_dtype)
    if _current(path, recipe_key):
        return True
    decode = session._plans.current().decode(1)
    prefills = [DecodePlan.build(model, rows, True) for rows in PREFILL_LADDER]
    if decode is None or any(p is None for p in prefills):
        return False
    return write(model, [decode, *prefills], path, recipe_key, multiplies(model))


def _current(path: str, recipe_key: dict) -> bool:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            _, body = _header(f, size, path)
        return body.get("key") == recipe_key
    except (OSError, ModelFormatError, ValueError):
        return False
