"""``tmac.Embedding``: a drop-in, inference-only ``nn.Embedding`` whose table stays quantized.

A token table is read one row per token, so it needs no kernel: the rows asked for are dequantized on lookup
(``s·(q − offset) − z``, float32 out). Stored as a ``QuantizedWeight``'s codes, bit-packed row-major
(``STORAGE_BITS`` bits per code: 3-bit codes take a nibble, 5- and 6-bit ones a byte), and its scales/zeros in the
format's dtypes — SmolLM2's Q8_0 table is 30 MB this way instead of 113 MB of float32, and its rows are bit-exact
``gguf.quants.dequantize`` rows.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import nn

from tmac.base.formats import PER_TENSOR, STORAGE_BITS, WeightFormat
from tmac.base.qweight import QuantizedWeight, RowCodes

STATE_VERSION = 1


class Embedding(nn.Module):
    def __init__(self, qw: QuantizedWeight):
        super().__init__()
        if not isinstance(qw, QuantizedWeight):
            raise TypeError(f"tmac.Embedding takes a QuantizedWeight, got {type(qw).__name__}")
        if qw.shape[1] * STORAGE_BITS[qw.format.bits] % 8:
            raise ValueError(f"embedding_dim {qw.shape[1]} does not fill whole bytes at {qw.format.bits} bits")
        self._set(qw.format, qw.shape, self._held_codes(qw),
                  torch.from_numpy(qw.scales.astype(qw.format.scale_dtype)),
                  None if qw.zeros is None else torch.from_numpy(qw.zeros.astype(qw.format.zero_dtype)))

    def _held_codes(self, qw: QuantizedWeight) -> torch.Tensor | None:
        """The codes this table holds: ``qw``'s, bit-packed."""
        return _pack_codes(qw.codes, qw.format.bits)

    def _set(self, fmt: WeightFormat, shape: tuple[int, int], codes, scales, zeros) -> None:
        self.format = fmt
        self.num_embeddings, self.embedding_dim = shape
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32, torch.int16,
                                                                  torch.uint8):
            raise TypeError(f"token ids must be an integer torch.Tensor, got "
                            f"{getattr(ids, 'dtype', type(ids).__name__)}")
        flat = ids.reshape(-1).long()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token ids must lie in [0, {self.num_embeddings}), got "
                             f"[{int(flat.min())}, {int(flat.max())}]")
        return self._rows(flat).reshape(*ids.shape, self.embedding_dim)

    def row(self, token: int) -> torch.Tensor:
        """Row ``token`` as float32 ``[embedding_dim]`` (the caller checks the range, as for a tensor index); the
        decode path has this lookup compiled (``tmac.base.glue``: ``embed``)."""
        return self._rows(torch.tensor([token]))[0]

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self._dequantized(rows, self._codes(self.codes[rows]))

    def _dequantized(self, rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor | None = None,
                     zeros: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 rows ``rows`` of the table from their uint8 ``codes`` ``[n, embedding_dim]`` (and, given, their own
        ``scales`` and ``zeros`` instead of the held table's)."""
        fmt, d = self.format, self.embedding_dim
        q = torch.tensor(fmt.codebook, dtype=torch.float32)[codes.long()] if fmt.codebook is not None else \
            codes.float() - fmt.offset
        per_tensor = fmt.group_size == PER_TENSOR
        if scales is None:
            scales, zeros = self.scales, self.zeros
            scales, zeros = (p if p is None or per_tensor else p[rows] for p in (scales, zeros))
        groups = 1 if per_tensor else scales.shape[1]

        def expand(p):
            return p.float().reshape(-1, groups, 1)

        w = q.reshape(len(rows), groups, d // groups) * expand(scales)
        if zeros is not None:
            w = w - expand(zeros)
        return w.reshape(len(rows), d)

    def _codes(self, packed: torch.Tensor) -> torch.Tensor:
        """uint8 codes ``[n, embedding_dim]`` of packed rows ``[n, embedding_dim·STORAGE_BITS/8]``."""
        slot = STORAGE_BITS[self.format.bits]
        shifts = torch.arange(0, 8, slot, dtype=torch.uint8)
        return ((packed.unsqueeze(-1) >> shifts) & ((1 << slot) - 1)).reshape(len(packed), self.embedding_dim)

    def _check_codes(self) -> None:
        """Codes in the format's range, like any ``QuantizedWeight``'s, checked a row slice at a time and only where
        a code's storage can hold more (a table in a mapped file stays unread until its rows are looked up)."""
        lo, hi = self.format.code_range
        if (lo, hi) == (0, (1 << STORAGE_BITS[self.format.bits]) - 1):
            return
        from tmac.base.memory import release_read_pages

        step = max(1, PACK_SLICE // self.embedding_dim)
        for r0 in range(0, self.num_embeddings, step):
            codes = self._codes(self.codes[r0:r0 + step])
            release_read_pages(self.codes[r0:r0 + step])
            if codes.numel() and (int(codes.min()) < lo or int(codes.max()) > hi):
                raise ValueError(f"codes of format {self.format.name} must lie in [{lo}, {hi}], got "
                                 f"[{int(codes.min())}, {int(codes.max())}] in rows {r0}..")

    def quantized_weight(self) -> QuantizedWeight:
        return QuantizedWeight(self._codes(self.codes).numpy(), self.scales.float().numpy(),
                               None if self.zeros is None else self.zeros.float().numpy(), self.format)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized float32 table (materialized on each access: for inspection, not for lookups)."""
        return torch.from_numpy(self.quantized_weight().dequantize())

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.format.name}"

    # ---- state dict ------------------------------------------------------------------------------------------
    def get_extra_state(self) -> dict:
        return {"version": STATE_VERSION, "kind": "embedding", "format": self.format.to_dict(),
                "num_embeddings": self.num_embeddings, "embedding_dim": self.embedding_dim}

    def set_extra_state(self, state) -> None:  # handled in _load_from_state_dict, with the tensors
        pass

    @classmethod
    def _empty(cls, extra: dict) -> "Embedding":
        """A module shaped by a saved extra state, to be filled by ``load_state_dict``."""
        fmt, v, d = _parse_extra(extra)
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        shapes = _shapes(fmt, v, d)
        self._set(fmt, (v, d), torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=getattr(torch, fmt.scale_dtype)),
                  torch.empty(0, dtype=getattr(torch, fmt.zero_dtype)) if "zeros" in shapes else None)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        names = ("codes", "scales", "zeros", "_extra_state")
        for key in state_dict:
            rest = key[len(prefix):]
            if key.startswith(prefix) and rest not in names and "." not in rest:
                unexpected_keys.append(key)
        try:
            fmt, v, d = _parse_extra(state_dict.get(prefix + "_extra_state"))
            if fmt != self.format or (v, d) != (self.num_embeddings, self.embedding_dim):
                raise ValueError(f"checkpoint holds a {fmt.name} table [{v}, {d}], this layer is "
                                 f"{self.format.name} [{self.num_embeddings}, {self.embedding_dim}]")
            tensors = {}
            for name, (shape, dtype) in _shapes(fmt, v, d).items():
                t = state_dict.get(prefix + name)
                if t is None:
                    missing_keys.append(prefix + name)
                    return
                if t.dtype != dtype or tuple(t.shape) != shape:
                    raise ValueError(f"{name} must be {dtype} of shape {shape}, got {t.dtype} {tuple(t.shape)}")
                tensors[name] = t.detach().cpu().contiguous()
            self._set(fmt, (v, d), tensors["codes"], tensors["scales"], tensors.get("zeros"))
            self._check_codes()
        except (ValueError, TypeError) as e:
            error_msgs.append(f"{prefix or 'tmac.Embedding '}: {e}")


class StreamedEmbedding(Embedding):
    """A ``tmac.Embedding`` whose codes stay in the model file (``RowCodes``: a GGUF's table, decoded a row at a
    time from the mapped blocks as tokens are looked up), and its scales and zeros with them where the table's format
    is the file's type (a K-quant table's float32 parameters were 2-4 bits a weight beside the file's 2.6-6.6, 48 MB
    for a Q2_K table of 49152 × 2048); other tables hold theirs. A tied table is then held once, as the head's packed
    weights, and an untied one not at all. ``codes`` (and streamed ``scales``, ``zeros``) materialize on each access
    (a checkpoint, a comparison); lookups never do."""

    def _held_codes(self, qw: QuantizedWeight) -> None:
        """None: the codes stay in the file, read through ``qw``'s ``RowCodes``."""
        if not isinstance(qw.codes, RowCodes):
            raise TypeError("StreamedEmbedding takes a QuantizedWeight whose codes stay in a file (RowCodes)")
        self._stream = qw.codes
        return None

    def _set(self, fmt, shape, codes, scales, zeros) -> None:
        self.format = fmt
        self.num_embeddings, self.embedding_dim = shape
        row = fmt.gguf
        self._decoder = row.decoder() if row is not None and self._stream.blocks is not None and \
            row.type_name == self._stream.type_name else None
        if self._decoder is None:  # (per-row or float16-zero variants of the type: their own parameters)
            self.register_buffer("scales", scales)
            self.register_buffer("zeros", zeros)

    def __getattr__(self, name: str):
        if name in ("scales", "zeros") and self.__dict__.get("_decoder") is not None:
            return self._file_params()[name == "zeros"]
        return super().__getattr__(name)

    def _params(self, s, z, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A decoder's scales and zeros of ``n`` rows as tensors ``[n, groups]`` in the format's dtypes."""
        fmt = self.format
        groups = fmt.groups_per_row(self.embedding_dim)
        return torch.from_numpy(np.asarray(s).reshape(n, groups).astype(fmt.scale_dtype)), \
            None if z is None else torch.from_numpy(np.asarray(z).reshape(n, groups).astype(fmt.zero_dtype))

    def _decoded(self, rows: np.ndarray):
        """Codes, scales and zeros of rows ``rows`` from the file's blocks, by the type's decoder: the values
        ``import_gguf`` gave the table."""
        fmt = self.format
        with np.errstate(invalid="ignore", over="ignore"):
            codes, s, z = self._decoder(self._stream.blocks[rows].reshape(-1, fmt.gguf.type_size), fmt.offset)
        return np.asarray(codes).reshape(len(rows), self.embedding_dim), *self._params(s, z, len(rows))

    def _file_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole table's scales and zeros from the file's blocks, by the type's parameter decoder where it has
        one (the codes are not decoded)."""
        fmt, blocks = self.format, self._stream.blocks
        decode = fmt.gguf.scale_decoder()
        step = max(1, PARAM_SLICE // fmt.groups_per_row(self.embedding_dim))  # (a few float64 temporaries a group)
        scales, zeros = [], []
        for r0 in range(0, self.num_embeddings, step):
            part = np.ascontiguousarray(blocks[r0:r0 + step]).reshape(-1, fmt.gguf.type_size)
            with np.errstate(invalid="ignore", over="ignore"):
                s, z = decode(part, fmt.offset) if decode is not None else self._decoder(part, fmt.offset)[1:]
            s, z = self._params(s, z, min(step, self.num_embeddings - r0))
            scales.append(s)
            if z is not None:
                zeros.append(z)
        return torch.cat(scales), torch.cat(zeros) if zeros else None

    @property
    def codes(self) -> torch.Tensor:
        return _pack_codes(self._stream, self.format.bits)

    @property
    def blocks(self) -> torch.Tensor | None:
        """The file's blocks ``[num_embeddings, row bytes]`` (uint8, read-only), and their GGUF type
        (``blocks_type``)."""
        if self._stream.blocks is None:
            return None
        with warnings.catch_warnings():  # a read-only mapping: nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(self._stream.blocks)

    @property
    def blocks_type(self) -> str:
        return self._stream.type_name

    def held(self) -> Embedding:
        """The same table with its codes in memory (what a checkpoint of it loads as)."""
        table = Embedding.__new__(Embedding)
        nn.Module.__init__(table)
        scales, zeros = self._file_params() if self._decoder is not None else (self.scales, self.zeros)
        table._set(self.format, (self.num_embeddings, self.embedding_dim), self.codes, scales, zeros)
        return table

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        if self._decoder is not None:  # the rows' blocks decoded whole: codes, scales and zeros
            codes, s, z = self._decoded(rows.numpy())
            return self._dequantized(rows, torch.from_numpy(codes), s, z)
        codes = np.concatenate([self._stream[r:r + 1] for r in rows.tolist()]) if len(rows) else \
            np.empty((0, self.embedding_dim), np.uint8)
        return self._dequantized(rows, torch.from_numpy(codes))

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "codes"] = self.codes  # a checkpoint holds them (loaded as a plain Embedding)
        if self._decoder is not None:
            scales, zeros = self._file_params()
            destination[prefix + "scales"] = scales
            if zeros is not None:
                destination[prefix + "zeros"] = zeros


def _pack_codes(codes, bits: int) -> torch.Tensor:
    """Codes (an array or ``RowCodes``) at ``STORAGE_BITS`` each, row-major, a row slice at a time."""
    slot = STORAGE_BITS[bits]
    per = 8 // slot
    if per == 1 and isinstance(codes, np.ndarray):  # 8-bit codes are their own packing: shared, not copied
        out = np.ascontiguousarray(codes, dtype=np.uint8)
        return torch.from_numpy(out if out.flags.writeable else out.copy())
    m, k = codes.shape
    out = np.empty((m, k // per), np.uint8)
    step = max(1, PACK_SLICE // k)
    for r0 in range(0, m, step):
        c = np.asarray(codes[r0:r0 + step]).reshape(-1, k // per, per)
        part = c[..., 0].astype(np.uint8)
        for j in range(1, per):
            part |= c[..., j] << np.uint8(j * slot)
        out[r0:r0 + step] = part
    return torch.from_numpy(out)


PACK_SLICE = 1 << 20  # codes packed at a time (a slice of RowCodes: its decoding temporaries too)
PARAM_SLICE = 1 << 19  # groups whose parameters a streamed table decodes at a time


def _shapes(fmt: WeightFormat, v: int, d: int) -> dict:
    s_shape = fmt.scale_shape(v, d)
    shapes = {"codes": ((v, d * STORAGE_BITS[fmt.bits] // 8), torch.uint8),
              "scales": (s_shape, getattr(torch, fmt.scale_dtype))}
    if fmt.has_zeros:
        shapes["zeros"] = (s_shape, getattr(torch, fmt.zero_dtype))
    return shapes


def _parse_extra(extra) -> tuple[WeightFormat, int, int]:
    if not isinstance(extra, dict) or extra.get("version") != STATE_VERSION or extra.get("kind") != "embedding":
        raise ValueError(f"not a tmac.Embedding state (version {STATE_VERSION}): {extra!r:.200}")
    v, d = extra.get("num_embeddings"), extra.get("embedding_dim")
    if type(v) is not int or type(d) is not int or v < 1 or d < 1:
        raise ValueError(f"malformed tmac.Embedding state: num_embeddings={v!r:.50}, embedding_dim={d!r:.50}")
    fmt = WeightFormat.from_dict(extra.get("format"))
    fmt.groups_per_row(d)  # raises when the group size does not divide the row
    if d * STORAGE_BITS[fmt.bits] % 8:
        raise ValueError(f"embedding_dim {d} does not fill whole bytes at {fmt.bits} bits")
    return fmt, v, d
