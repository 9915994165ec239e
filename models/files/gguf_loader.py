"""GGUF files of every family ``tmac.models.family.arch`` lists: config, tokenizer and weights, read lazily from the
memory-mapped file. The record says which tensors and metadata keys a family has.

Weights come back as ``QuantizedWeight`` when the caller wants the file's own weights (``exact``): imported exactly
where the type allows (``tmac.base.formats.GGUF_EXACT``: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K to Q6_K,
TQ1_0, TQ2_0, the i-quants IQ1_M to IQ4_XS as codebook codes — the grid types' held by the kernels as the file's
indices and signs on AVX-512 VBMI (1.04-1.12x the file), as 4-bit codes elsewhere (above the files' 1.75-3.44
bits) — and IQ1_S as a K-quant of 2-bit codes, held as its indices on AVX-512 VBMI too), and a matrix of any other quantized type (MXFP4) at 8 bits in
Q8_0's layout — within a fraction of the type's own rounding, at a quarter of float32's bytes and several times its
speed.
Otherwise tensors come as float32 (F32 read directly, every other type through ``gguf.quants.dequantize``) or
F16/BF16 in their own dtype; matrices as ``DequantizedRows``: float32 a row slice at a time, so that requantizing
one never holds a float32 copy of it whole (a 49152-row head: 400 MB), or whole in their dtype. GGUF stores q/k rows
interleaved for llama.cpp's RoPE; they are permuted back to the Hugging Face "rotate half" order the model uses (a
row permutation, so exact imports stay exact).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch

from tmac.base.errors import InexactImport, ModelFormatError
from tmac.base.float_linear import all_finite
from tmac.base.formats import GGUF_EXACT, GGUF_FLOAT_TYPES, Q8_0_LAYOUT
from tmac.quant.quantize import import_gguf, quantize_weight
from tmac.base.qweight import QuantizedWeight

from tmac.models.family.arch import BY_GGUF, tensor_names
from tmac.models.files.gguf_file import GGUFFile
from tmac.models.family.llama import LlamaConfig
from tmac.models.text.tokenizer import Tokenizer

DEQUANT_ROWS = 1024


class GGUFModel:
    """An open GGUF file: ``config``, ``tokenizer`` and ``weight(name, exact)``."""

    def __init__(self, path: str, mmap: bool = True):
        self.path = path
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no such model file: {path}")
        self.file = file = GGUFFile(path, mmap)
        self.meta, self.tensors = file.metadata, file.tensors
        self.config = self._config()
        self.tokenizer = Tokenizer.from_gguf_metadata(self.meta, path, self.config.vocab_size)

    def _config(self) -> LlamaConfig:
        name = self.meta.get("general.architecture")
        arch = self.arch = BY_GGUF.get(name) if isinstance(name, str) else None
        if arch is None:
            raise ModelFormatError(f"{self.path}: architecture {name!r:.40} is not supported; supported: "
                                   f"{', '.join(BY_GGUF)}")

        def get(key, kind, default=None):
            value = self.meta.get(f"{name}.{key}", default)
            if value is None:
                raise ModelFormatError(f"{self.path}: metadata {name}.{key} is missing")
            if kind is int and type(value) is not int or kind is float and not isinstance(value, (int, float)):
                raise ModelFormatError(f"{self.path}: metadata {name}.{key}={value!r:.50} is not a {kind.__name__}")
            return kind(value)

        n_heads = get("attention.head_count", int)
        embd = self.tensors.get("token_embd.weight")
        if embd is None:
            raise ModelFormatError(f"{self.path}: tensor token_embd.weight is missing")
        scales = [t for t in self.tensors if t.endswith(".scale")]
        if scales:  # BitNet conversions that keep a per-tensor scale apart (llama.cpp's wq_scale …)
            raise ModelFormatError(f"{self.path}: tensor {scales[0]} (a projection's separate scale) is not supported")
        n_layers, dim = get("block_count", int), get("embedding_length", int)
        head_dim = get("attention.key_length", int, 0)
        window = get("attention.sliding_window", int, 0) if arch.gguf_swa_every else 0
        linear = get("rope.scaling.factor", float, 1.0) if self.meta.get(f"{name}.rope.scaling.type") == "linear" \
            else 1.0
        try:
            return LlamaConfig(**dict(dict(
                vocab_size=embd.shape[0], dim=dim, n_layers=n_layers, n_heads=n_heads,
                n_kv_heads=get("attention.head_count_kv", int, n_heads), ffn_dim=get("feed_forward_length", int),
                head_dim=head_dim, norm_eps=get("attention.layer_norm_rms_epsilon", float, 1e-5),
                rope_theta=get("rope.freq_base", float, 10000.0),
                rope_scaling={"rope_type": "linear", "factor": linear} if linear != 1.0 else None,
                context_length=get("context_length", int, 2048),
                tie_embeddings="output.weight" not in self.tensors, activation=arch.gguf_activation,
                **arch.config_flags(), embed_scale=float(dim) ** 0.5 if arch.embed_scale else 1.0,
                rotary_dim=get("rope.dimension_count", int, 0), sliding_window=window,
                sliding_layers=[i for i in range(n_layers) if (i + 1) % arch.gguf_swa_every] if window else None,
                rope_local_theta=arch.gguf_local_rope_theta if window else 0.0, **self._rope_factors(get),
                nope_layers=[i for i in range(n_layers) if (i + 1) % arch.gguf_nope_every == 0]
                if arch.gguf_nope_every else None),
                **{field: get(key, float) for field, key in arch.gguf_keys.items() if f"{name}.{key}" in self.meta}))
        except ValueError as e:
            raise ModelFormatError(f"{self.path}: {e}") from None

    def stored_name(self, name: str) -> str:
        """The file's name of our parameter ``name``."""
        return tensor_names(self.arch, name)[0]

    def has(self, name: str) -> bool:
        """Whether the file stores our parameter ``name``."""
        return tensor_names(self.arch, name)[0] in self.tensors

    def weight(self, name: str, exact: bool = False) -> torch.Tensor | QuantizedWeight:
        """The tensor ``name`` (our naming); a ``QuantizedWeight`` when ``exact`` and the file stores it quantized."""
        gname = tensor_names(self.arch, name)[0]
        t = self.tensors.get(gname)
        if t is None:
            raise ModelFormatError(f"{self.path}: tensor {gname} is missing")
        shape, type_name = t.shape, t.type_name
        if type_name in INTEGER_TYPES:
            raise ModelFormatError(f"{self.path}: tensor {gname} has the integer type {type_name}, not a weight type")
        matrix, value = len(shape) == 2, None
        if exact and matrix and type_name in GGUF_EXACT:
            # a rare block the format cannot hold exactly (InexactImport): the tensor comes at 8 bits below
            with contextlib.suppress(InexactImport), _naming(self.path, t):
                value = import_gguf(t.data, type_name, shape, lambda: self.file.release(t))
        if value is None:
            if exact and matrix and type_name not in GGUF_FLOAT_TYPES:
                return quantize_weight(self.weight(name), **Q8_0_LAYOUT)
            if matrix and self._rope_heads(name) == 0:
                return DequantizedRows(self, t)
            with _naming(self.path, t):
                value = _as_torch(t.data, type_name, shape)
        self.file.release(t)  # converted: its pages need not stay resident
        return self._unpermute(name, value)

    def _rope_factors(self, get) -> dict:
        """RoPE frequency divisors as llama.cpp's converter stores them: Llama 3.1+'s ``rope_freqs.weight``; LongRoPE's
        ``rope_factors_short``/``_long`` (Phi-3.5, Phi-4-mini) with the context between them and the factor on cos and
        sin. F32, rotary_dim/2 of them (LlamaConfig checks the count)."""
        factors = {name: self._factors(f"{name}.weight")
                   for name in ("rope_freqs", "rope_factors_short", "rope_factors_long")}
        if factors["rope_factors_long"] is None:
            return {"rope_factors": factors["rope_freqs"] or factors["rope_factors_short"]}
        return dict(rope_factors=factors["rope_factors_short"] or factors["rope_factors_long"],
                    rope_factors_long=factors["rope_factors_long"],
                    rope_original_context=get("rope.scaling.original_context_length", int),
                    rope_attn_factor=get("rope.scaling.attn_factor", float, 1.0))

    def _factors(self, gname: str) -> list | None:
        t = self.tensors.get(gname)
        if t is None:
            return None
        if t.type_name != "F32" or len(t.shape) != 1 or t.shape[0] > 1 << 12:
            raise ModelFormatError(f"{self.path}: tensor {gname} is {t.type_name} {list(t.shape)}; expected F32 "
                                   f"[rotary_dim/2]")
        factors = t.data.view(np.float32).astype(np.float64)
        if not np.isfinite(factors).all() or (factors <= 0).any():
            raise ModelFormatError(f"{self.path}: tensor {gname} holds factors that are not positive")
        return factors.tolist()

    def _rope_heads(self, name: str) -> int:
        """Heads whose rows the file interleaves for llama.cpp's RoPE (llama's q and k projections), else 0."""
        cfg = self.config
        if not self.arch.gguf_interleaved_qk:
            return 0
        return cfg.n_heads if name.endswith("wq.weight") else cfg.n_kv_heads if name.endswith("wk.weight") else 0

    def _unpermute(self, name, value):
        cfg = self.config
        heads = self._rope_heads(name)
        if not heads:
            return value
        rows = value.shape[0]
        if rows != heads * cfg.head_dim:
            raise ModelFormatError(f"{self.path}: {name} has {rows} rows, expected {heads}×{cfg.head_dim}")
        order = np.arange(rows).reshape(heads, cfg.head_dim // 2, 2).transpose(0, 2, 1).reshape(-1)
        if isinstance(value, QuantizedWeight):
            return value.take_rows(order)
        return value[torch.from_numpy(order)]


class DequantizedRows:
    """A float matrix of the file, dequantized on demand: ``rows(start, stop)`` (float32 numpy, what
    ``tmac.quantize_weight`` reads a slice at a time) or ``tensor()`` (all of it, torch)."""

    def __init__(self, model: GGUFModel, t):
        self.model, self.tensor_info, self.shape = model, t, tuple(t.shape)

    def rows(self, start: int, stop: int) -> np.ndarray:
        t, m = self.tensor_info, self.shape[0]
        start, stop = max(0, start), min(m, stop)
        with _naming(self.model.path, t):
            part = _dequantize(t.data.reshape(m, -1)[start:stop], t.type_name, (stop - start, *self.shape[1:]))
        if stop == m:  # read to the end: the file's pages need not stay resident
            self.model.file.release(t)
        return part

    def tensor(self) -> torch.Tensor:
        """All of it: float16 and bfloat16 tensors in their own dtype, others dequantized to float32."""
        t = self.tensor_info
        with _naming(self.model.path, t):
            a = _as_torch(t.data, t.type_name, self.shape)
        self.model.file.release(t)
        return a


@contextlib.contextmanager
def _naming(path: str, t):
    """Conversion errors as a ``ModelFormatError`` naming the file and the tensor."""
    try:
        yield
    except InexactImport:
        raise
    except ValueError as e:
        raise ModelFormatError(f"{path}: tensor {t.name} ({t.type_name}, {t.shape}): {e}") from None
    except NotImplementedError:  # a GGML type the gguf package has no dequantizer for (Q8_1, Q8_K: never weights)
        raise ModelFormatError(f"{path}: tensor {t.name} has the type {t.type_name}, which no GGUF model stores "
                               f"weights in") from None


INTEGER_TYPES = ("I8", "I16", "I32", "I64")  # GGML types of indices and counts, never of a model's weights


def _as_torch(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor's values as torch: F16 and BF16 in their own dtype (16-bit weights stay 16-bit), others as
    float32 (``_dequantize``)."""
    if type_name not in ("F16", "BF16"):
        return torch.from_numpy(_dequantize(data, type_name, shape))
    a = torch.from_numpy(data.reshape(-1).view(np.int16).copy()).view(
        torch.float16 if type_name == "F16" else torch.bfloat16).reshape(shape)  # a copy: the pages stay shared
    if not all_finite(a):
        raise ValueError("contains NaN or inf")
    return a


def _dequantize(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Float32 values of a tensor's raw bytes (a copy: the file's pages stay read-only and shared)."""
    with np.errstate(over="ignore", invalid="ignore"):  # damaged values are refused below, not warned about
        a = _dequantized(data, type_name, shape)
    if not np.isfinite(a).all():
        raise ValueError("contains NaN or inf")
    return a


def _dequantized(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    if type_name == "F32":
        a = data.view(np.float32).copy()
    elif type_name == "F64":
        a = data.view(np.float64).astype(np.float32)
    elif type_name == "F16":
        a = data.view(np.float16).astype(np.float32)
    elif type_name == "BF16":
        a = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        import gguf  # (only here: its import is 4 MiB of memory, and float tensors do without it)

        rows = data.reshape(int(np.prod(shape[:-1], dtype=np.int64)), -1)
        qtype = gguf.GGMLQuantizationType[type_name]
        a = np.empty((rows.shape[0], shape[-1]), dtype=np.float32)
        for start in range(0, rows.shape[0], DEQUANT_ROWS):  # in slices: the dequantizer's temporaries stay small
            a[start:start + DEQUANT_ROWS] = gguf.quants.dequantize(rows[start:start + DEQUANT_ROWS], qtype)
    return a.reshape(shape)
