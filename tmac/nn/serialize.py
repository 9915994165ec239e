"""``tmac.save`` / ``tmac.load``: a model's state dict as safetensors — tensors plus JSON metadata, no pickle.

The file holds every tensor of ``model.state_dict()`` once (tied weights are stored once and recorded as
aliases) and, in the safetensors metadata, the JSON extra states of ``tmac.Linear`` layers (format and
kernel spec). ``load`` needs the model to fill — typically the float architecture built on the ``meta``
device — and turns the ``nn.Linear`` / ``nn.Embedding`` layers the file holds quantized into ``tmac.Linear`` /
``tmac.Embedding`` first.
"""

from __future__ import annotations

import json
import math
import os
import struct

import torch
from torch import nn

from tmac.base import files
from tmac.base.errors import ModelFormatError
from tmac.quant.embedding import Embedding
from tmac.base.float_linear import FLOAT_LINEARS
from tmac.nn.linear import Linear
from tmac.base.memory import ALIGN, mapped_file, read_file

FILE_VERSION = 2  # 2: every tensor starts on an ``ALIGN`` boundary of the file (1: where safetensors put it)
READ_VERSIONS = (1, 2)
PAD_PREFIX = "tmac:pad:"  # uint8 tensors that fill the gaps between aligned tensors (safetensors allows no holes)
BUFFERS_KEY = "tmac:buffers"  # in read_state's dict: the names of the tensors that are non-persistent buffers


def save(model: nn.Module, path: str | os.PathLike, model_info: dict | None = None) -> None:
    """Write ``model``'s state dict to ``path``; ``model_info`` (JSON) describes how to rebuild the model. The file
    is a safetensors file whose tensors start on cache-line boundaries, in the order a forward pass reads them, so
    that ``load`` maps it and the kernels read the file's pages as they are."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"tmac.save takes an nn.Module, got {type(model).__name__}")
    tensors, extras, aliases, seen = {}, {}, {}, {}
    for key, value in model.state_dict().items():
        if isinstance(value, torch.Tensor):
            ident = (value.untyped_storage().data_ptr(), value.storage_offset(), value.dtype, tuple(value.shape),
                     value.stride())
            if value.numel() and ident in seen:
                aliases[key] = seen[ident]
                continue
            seen[ident] = key
            tensors[key] = value.detach().cpu().contiguous()
        else:
            try:
                json.dumps(value)
            except TypeError:
                raise TypeError(f"state {key!r} is a {type(value).__name__}, which tmac.save cannot store without "
                                f"pickle (only tensors and JSON extra states)") from None
            extras[key] = value
    # buffers left out of the state dict (a rotary embedding's inv_freq): computed at construction, so a skeleton
    # built on the meta device lacks them; stored so that loading fills them too
    buffers = [name for name, b in model.named_buffers() if name not in tensors and name not in aliases
               and isinstance(b, torch.Tensor)]
    for name in buffers:
        tensors[name] = model.get_buffer(name).detach().cpu().contiguous().clone()
    meta = {"format": "pt", "tmac": json.dumps({"version": FILE_VERSION, "extra_state": extras, "aliases": aliases,
                                                "buffers": buffers})}
    if model_info is not None:
        meta["tmac_model"] = json.dumps(model_info)
    path = os.fspath(path)
    files.check_output(path)
    files.write_atomically(path, lambda tmp: _write_aligned(tmp, tensors, meta), "tmac-save",
                           needed=sum(t.numel() * t.element_size() for t in tensors.values()))


def _write_aligned(path: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """A safetensors file of ``tensors`` in their order, each starting on an ``ALIGN`` boundary of the file (the
    header padded with spaces, the gaps filled by ``PAD_PREFIX`` tensors)."""
    names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    header, layout, at = {}, [], 0
    for key, t in tensors.items():
        if t.dtype not in names:
            raise TypeError(f"tensor {key} has dtype {t.dtype}; tmac files hold {', '.join(map(str, names))}")
        gap = -at % ALIGN
        if gap:
            header[f"{PAD_PREFIX}{len(layout)}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [at, at + gap]}
            layout.append(bytes(gap))
            at += gap
        header[key] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
        layout.append(t)
        at += t.nbytes
    header["__metadata__"] = meta
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for part in layout:
            f.write(part if isinstance(part, bytes) else memoryview(part.reshape(-1).view(torch.uint8).numpy()))


def load(path: str | os.PathLike, model: nn.Module | None = None, *, strict: bool = True,
         mmap: bool = True) -> nn.Module:
    """Fill ``model`` (e.g. built under ``torch.device("meta")``) from a file ``tmac.save`` wrote; returns it.
    ``mmap``: its tensors view a mapping of the file (shared page cache, nothing copied), else the file is read into
    memory (a file replaced in place meanwhile cannot harm the run)."""
    if model is None:
        raise TypeError("tmac.load(path, model) needs the model to fill, e.g. the float architecture built under "
                        "torch.device('meta'); the file stores weights, not code")
    if not isinstance(model, nn.Module):
        raise TypeError(f"tmac.load fills an nn.Module, got {type(model).__name__}")
    state = read_state(path, mmap)
    for key, extra in state.items():
        if not key.endswith("_extra_state") or not isinstance(extra, dict):
            continue
        prefix = key[:-len("_extra_state")].rstrip(".")
        parent_name, _, child = prefix.rpartition(".")
        try:
            parent = model.get_submodule(parent_name)
            current = getattr(parent, child)
        except AttributeError:
            continue  # load_state_dict reports the unexpected key
        try:
            if type(current) in FLOAT_LINEARS and "spec" in extra:
                new = Linear._empty(extra, state.get(prefix + ".qweight" if prefix else "qweight"))
                dims = ("out_features", "in_features")
            elif type(current) is nn.Embedding and extra.get("kind") == "embedding":
                new, dims = Embedding._empty(extra), ("num_embeddings", "embedding_dim")
            else:
                continue
        except (ValueError, TypeError) as e:
            raise ModelFormatError(f"{path}: layer {prefix}: {e}") from None
        saved, wanted = (tuple(getattr(m, d) for d in dims) for m in (new, current))
        if saved != wanted:
            raise ModelFormatError(f"{path}: layer {prefix} is {dims[0]} x {dims[1]} = {saved[0]} x {saved[1]} in "
                                   f"the file but {wanted[0]} x {wanted[1]} in the model it is loaded into")
        setattr(parent, child, new)
    buffers = {name: state.pop(name) for name in state.pop(BUFFERS_KEY, [])}
    meta_params = any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers())
    try:
        model.load_state_dict(state, strict=strict, assign=meta_params)
    except RuntimeError as e:
        raise ModelFormatError(f"{path}: {e}") from None
    for name, value in buffers.items():
        parent_name, _, child = name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name)
        except AttributeError:
            continue
        current = parent._buffers.get(child)
        if isinstance(current, torch.Tensor) and current.shape != value.shape:
            raise ModelFormatError(f"{path}: buffer {name} is {tuple(value.shape)} in the file but "
                                   f"{tuple(current.shape)} in the model it is loaded into")
        if child in parent._buffers:
            parent._buffers[child] = value
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ModelFormatError(f"{path}: the file does not fill {', '.join(left[:5])}"
                               f"{' …' if len(left) > 5 else ''}: they stay on the meta device (a file saved by an "
                               f"older tmac lacks buffers outside the state dict; save the model again)")
    return model


def read_model_info(path: str | os.PathLike) -> dict | None:
    """The ``model_info`` a file was saved with (None for plain state dicts), reading only the header."""
    from safetensors import safe_open

    try:
        with safe_open(files.require_regular(os.fspath(path)), framework="pt") as f:
            info = (f.metadata() or {}).get("tmac_model")
        return None if info is None else files.parse_json(info, "its tmac_model metadata")
    except Exception as e:  # safetensors and json raise their own error types for malformed files
        raise ModelFormatError(f"{path}: not a readable tmac model file ({e})") from None


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def _map_tensors(path: str, mmap: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """The metadata and every tensor of a safetensors file, as views of one private, read-mostly mapping of it:
    the pages are the file's (shared with every process that maps it, read from disk as they are first touched)
    and nothing is copied; a tensor that does not start on an ``ALIGN`` boundary (a file of version 1) is copied
    into memory of its own. ``mmap=False``: views of the whole file read into memory instead (``read_file``)."""
    out = {}
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{size} bytes, shorter than a safetensors header")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise ValueError(f"header of {n} bytes in a file of {size}")
        if mmap:
            header = files.parse_json(f.read(n), path)
            data = mapped_file(f.fileno(), size) if size > 8 + n else None  # (this file, even if the path was
        else:                                                                # replaced)
            data = read_file(f, size, path)
            header = files.parse_json(data[8:8 + n].numpy().tobytes(), path)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    for key, entry in header.items():
        if key == "__metadata__" or key.startswith(PAD_PREFIX):
            continue
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {key} has dtype {entry['dtype']}; tmac files hold "
                             f"{', '.join(SAFETENSORS_DTYPES)}")
        shape, (start, end) = entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"tensor {key}: shape {shape!r:.80}")
        dtype, count = SAFETENSORS_DTYPES[entry["dtype"]], math.prod(shape)
        nbytes = count * dtype.itemsize
        if type(start) is not int or end != start + nbytes or start < 0 or 8 + n + end > size:
            raise ValueError(f"tensor {key}: bytes {start!r:.20}..{end!r:.20} for {entry['dtype']} of shape {shape}, "
                             f"or past the end of the file")
        at = 8 + n + start
        raw = data[at:at + nbytes] if nbytes else torch.empty(0, dtype=torch.uint8)
        if at % ALIGN:
            raw = raw.clone()
        out[key] = raw.view(dtype).view(shape)
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("__metadata__ is not an object of strings")
    return meta, out


def read_state(path: str | os.PathLike, mmap: bool = True) -> dict:
    """The state dict stored in ``path`` (tensors, aliases resolved, extra states), validated; ``mmap=False``:
    read into memory, not mapped (``_map_tensors``)."""
    from safetensors import safe_open

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such model file: {path}")
    try:
        if mmap:  # (safetensors validates the header and offsets, through a mapping of its own)
            with safe_open(files.require_regular(path), framework="pt") as f:
                f.metadata()
        else:
            files.require_regular(path)
        meta, state = _map_tensors(path, mmap)
    except Exception as e:  # safetensors raises its own error types for malformed headers
        raise ModelFormatError(f"{path}: not a readable safetensors file ({e})") from None
    try:
        info = files.parse_json(meta["tmac"], "its tmac metadata")
        if info.get("version") not in READ_VERSIONS:
            raise ValueError(f"file version {info.get('version')!r}, this tmac reads {READ_VERSIONS}")
        extras, aliases = info["extra_state"], info["aliases"]
        if not isinstance(extras, dict) or not isinstance(aliases, dict):
            raise ValueError("extra_state and aliases must be objects")
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise ModelFormatError(f"{path}: missing or malformed tmac metadata ({e})") from None
    for key, t in state.items():  # NaN/inf weights, scales or zeros would only surface as garbage text later
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ModelFormatError(f"{path}: tensor {key} contains NaN or inf")
    for key, target in aliases.items():
        if not isinstance(target, str) or target not in state:
            raise ModelFormatError(f"{path}: alias {key!r} points to missing tensor {target!r}")
        state[key] = state[target]
    buffers = info.get("buffers", [])
    if not isinstance(buffers, list) or not all(isinstance(b, str) and b in state for b in buffers):
        raise ModelFormatError(f"{path}: tmac metadata names buffers that are not in the file")
    state.update(extras)
    state[BUFFERS_KEY] = buffers
    return state
