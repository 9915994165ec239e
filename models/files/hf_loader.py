"""Hugging Face model directories: ``config.json`` + safetensors (single file or sharded index).

Float checkpoints of every family ``tmac.models.family.arch`` lists (the record names its classes and tensors), GPTQ ones,
and BitNet's packed ternary checkpoints ("offline"
``bitlinear``): uint8 ``[out/4, in]`` whose 2-bit fields hold w+1, packed row r holding rows r, r+R, r+2R,
r+3R (R = out/4) at bits 0, 2, 4, 6, and a scalar ``weight_scale`` that the reference *divides* by
(``y = x·Wq / weight_scale``), so the imported scale is 1/weight_scale. Tensors are read one at a time from
the memory-mapped safetensors files, in their own dtype; float matrices as ``SafetensorsRows``, a row slice at a
time when they are requantized.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from tmac.base import files as untrusted
from tmac.base.errors import ModelFormatError
from tmac.base.float_linear import all_finite
from tmac.base.formats import BITS, PER_TENSOR, WeightFormat
from tmac.base.qweight import QuantizedWeight

from tmac.models.family.arch import BY_HF, HF_ACTIVATIONS, tensor_names
from tmac.models.files.gptq import VERSIONS as GPTQ_VERSIONS
from tmac.models.files.jsonfile import read_json
from tmac.models.family.llama import LlamaConfig
from tmac.models.text.tokenizer import Tokenizer

ROPE_TYPES = ("default", "llama3", "linear", "longrope")
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the float dtypes


class SafetensorsRows:
    """A float matrix of the checkpoint, read on demand: ``rows(start, stop)`` (float32 numpy, what
    ``tmac.quantize_weight`` reads a slice at a time: a requantized head is never in memory whole) or ``tensor()``
    (all of it, in the file's dtype)."""

    def __init__(self, model: "HFModel", hf: str, shape: tuple[int, int]):
        self.model, self.hf, self.shape = model, hf, shape

    def rows(self, start: int, stop: int) -> np.ndarray:
        a = self.model._read(self.hf, lambda f: f.get_slice(self.hf)[start:stop]).float().numpy()
        if not np.isfinite(a).all():
            raise ModelFormatError(f"{self.model.path}: tensor {self.hf} contains NaN or inf")
        return a

    def tensor(self) -> torch.Tensor:
        return self.model._float(self.hf, self.model._tensor(self.hf))


class HFModel:
    """An open Hugging Face directory: ``config``, ``tokenizer`` (None without tokenizer.json) and ``weight``."""

    def __init__(self, path: str):
        self.path = path
        self.hf_config = read_json(os.path.join(path, "config.json"))
        self.files = self._index()
        self.config = self._config()
        has_tokenizer = os.path.exists(os.path.join(path, "tokenizer.json"))
        self.tokenizer = Tokenizer.from_hf_dir(path, self.config.vocab_size) if has_tokenizer else None

    def _index(self) -> dict[str, str]:
        """Tensor name → safetensors file."""
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.exists(index):
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ModelFormatError(f"{index}: weight_map missing or malformed")
            files = {}
            for name, file in weight_map.items():
                full = os.path.join(self.path, os.path.basename(file))  # never outside the directory
                if not os.path.exists(full):
                    raise ModelFormatError(f"{index}: shard {file} of tensor {name} does not exist")
                files[name] = full
            return files
        single = os.path.join(self.path, "model.safetensors")
        if not os.path.exists(single):
            raise ModelFormatError(f"{self.path}: neither model.safetensors nor model.safetensors.index.json")
        from safetensors import safe_open

        try:
            with safe_open(untrusted.require_regular(single), framework="pt") as f:
                return {name: single for name in f.keys()}
        except Exception as e:
            raise ModelFormatError(f"{single}: not a readable safetensors file ({e})") from None

    def _config(self) -> LlamaConfig:
        try:
            return self._parse_config(self.hf_config)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
            if isinstance(e, ModelFormatError):
                raise
            raise ModelFormatError(f"{self.path}/config.json: malformed ({type(e).__name__}: {e})") from None

    def _parse_config(self, c: dict) -> LlamaConfig:
        archs = c.get("architectures")
        name = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
        arch = self.arch = BY_HF.get(name)
        if arch is None:
            raise ModelFormatError(f"{self.path}/config.json: architecture {name!r} is not supported; supported: "
                                   f"{', '.join(BY_HF)}")
        hidden_act = c.get("hidden_activation") or c.get("hidden_act") or arch.hf_activations[0]
        if hidden_act not in arch.hf_activations:
            raise ModelFormatError(f"{self.path}/config.json: hidden_act {hidden_act!r:.40} is not supported for "
                                   f"{name} (supported: {', '.join(arch.hf_activations)})")
        for key, want in arch.hf_variants.items():
            if c.get(key, want) != want:
                raise ModelFormatError(f"{self.path}/config.json: {key}={c.get(key)!r:.40} is not supported for "
                                       f"{name} (only {want!r})")
        quant = c.get("quantization_config")
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        self.packed_ternary = method == "bitnet" and quant.get("linear_class", "bitlinear") == "bitlinear" \
            and quant.get("quantization_mode", "offline") == "offline"
        self.gptq = None
        if method == "gptq":
            if quant.get("desc_act"):
                raise ModelFormatError(f"{self.path}/config.json: GPTQ with desc_act=True (act-order) is not "
                                       f"supported; re-quantize with desc_act=False")
            self.gptq = {"bits": quant.get("bits"), "group_size": quant.get("group_size", 128),
                         "version": quant.get("checkpoint_format", "gptq")}
            for field, ok in (("bits", lambda v: type(v) is int and v in BITS),
                              ("group_size", lambda v: type(v) is int and (v == -1 or 0 < v <= 1 << 20)),
                              ("version", lambda v: v in GPTQ_VERSIONS)):
                if not ok(self.gptq[field]):
                    name = "checkpoint_format" if field == "version" else field
                    raise ModelFormatError(f"{self.path}/config.json: quantization_config.{name}="
                                           f"{self.gptq[field]!r:.40} is not supported")
        elif quant is not None and not self.packed_ternary:
            raise ModelFormatError(f"{self.path}/config.json: quantization_config {quant!r:.120} is not supported; "
                                   f"supported: none (float), GPTQ, BitNet offline bitlinear (packed ternary)")
        for key in ("num_attention_heads", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"):
            if type(c.get(key)) is not int or c[key] < 1:
                raise ModelFormatError(f"{self.path}/config.json: {key}={c.get(key)!r:.40} must be a positive int")
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        rope, local_theta = self._rope(c)
        partial = c.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
        window, sliding = self._sliding(c)
        query_scalar = c.get("query_pre_attn_scalar")
        return LlamaConfig(**dict(dict(
            vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=heads,
            n_kv_heads=c.get("num_key_value_heads") or heads, ffn_dim=c["intermediate_size"],
            head_dim=head_dim, norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            rope_scaling=rope if rope.get("rope_type") in ("llama3", "linear") else None,
            context_length=c.get("max_position_embeddings", 2048),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)) or "lm_head.weight" not in self.files,
            activation=HF_ACTIVATIONS[hidden_act], **arch.config_flags(),
            embed_scale=float(c["hidden_size"]) ** 0.5 if arch.embed_scale else 1.0,
            attn_scale=float(query_scalar) ** -0.5 if query_scalar else 0.0, rotary_dim=int(head_dim * partial),
            sliding_window=window, sliding_layers=sliding, rope_local_theta=local_theta,
            nope_layers=self._nope(c), **self._longrope(c, rope, int(head_dim * partial))),
            **{field: c[key] for field, key in arch.hf_keys.items() if c.get(key) is not None}))

    def _nope(self, c: dict) -> list | None:
        """The layers without RoPE: SmolLM3's ``no_rope_layers`` (1: the layer turns q and k, 0: it does not)."""
        flags = c.get("no_rope_layers")
        if flags is None:
            return None
        if not isinstance(flags, list) or len(flags) != c["num_hidden_layers"] or not all(f in (0, 1) for f in flags):
            raise ModelFormatError(f"{self.path}/config.json: no_rope_layers={flags!r:.60} is not a 0 or 1 for each "
                                   f"of the {c['num_hidden_layers']} layers")
        return [i for i, turns in enumerate(flags) if not turns] or None

    def _rope(self, c: dict) -> tuple[dict, float]:
        """The global layers' RoPE parameters (``rope_type`` always set) and the sliding layers' base (0: the same).
        transformers 5 writes ``rope_parameters`` (per layer type where they differ), 4 ``rope_scaling`` and
        ``rope_theta`` (``rope_local_base_freq``)."""
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ModelFormatError(f"{self.path}/config.json: rope parameters {rope!r:.60} are not an object")
        local = rope.get("sliding_attention")
        rope = rope.get("full_attention", rope)
        rope = {**rope, "rope_type": rope.get("rope_type", rope.get("type", "default"))}
        if rope["rope_type"] not in ROPE_TYPES:
            raise ModelFormatError(f"{self.path}/config.json: RoPE type {rope['rope_type']!r:.40} is not supported; "
                                   f"supported: {', '.join(ROPE_TYPES)}")
        if isinstance(local, dict) and local.get("rope_type", "default") != "default":
            raise ModelFormatError(f"{self.path}/config.json: sliding layers' RoPE type {local.get('rope_type')!r:.40}"
                                   f" is not supported")
        local_theta = local.get("rope_theta", 0.0) if isinstance(local, dict) else c.get("rope_local_base_freq", 0.0)
        return rope, float(local_theta)

    def _sliding(self, c: dict) -> tuple[int, list | None]:
        """The sliding window and the layers that have one: Gemma 3's ``layer_types`` (or its older
        ``sliding_window_pattern``), Mistral's window on every layer; none where the family turns it off."""
        window = c.get("sliding_window") or 0
        if not window or self.arch.hf_variants.get("use_sliding_window") is False:
            return 0, None
        types = c.get("layer_types")
        if isinstance(types, list):
            return window, [i for i, t in enumerate(types) if t == "sliding_attention"]
        every = c.get("sliding_window_pattern") or c.get("_sliding_window_pattern")
        if every:
            return window, [i for i in range(c["num_hidden_layers"]) if (i + 1) % every]
        return window, None

    def _longrope(self, c: dict, rope: dict, rotary_dim: int) -> dict:
        """LongRoPE (Phi-3.5, Phi-4-mini): the short and long frequency divisors, the context that separates them,
        and the factor on cos and sin (given, or √(1 + ln(factor) / ln(original context)))."""
        if rope["rope_type"] != "longrope":
            return {}
        original = rope.get("original_max_position_embeddings") or c.get("original_max_position_embeddings")
        short, long = rope.get("short_factor"), rope.get("long_factor")
        if type(original) is not int or original < 2 or not isinstance(short, list) or not isinstance(long, list):
            raise ModelFormatError(f"{self.path}/config.json: longrope needs short_factor, long_factor and "
                                   f"original_max_position_embeddings")
        factor = rope.get("factor") or c.get("max_position_embeddings", original) / original
        attention = rope.get("attention_factor") or (math.sqrt(1 + math.log(factor) / math.log(original))
                                                     if factor > 1 else 1.0)
        return dict(rope_factors=short, rope_factors_long=long, rope_original_context=original,
                    rope_attn_factor=attention)

    def stored_name(self, name: str) -> str:
        """The file's name of our parameter ``name``."""
        return tensor_names(self.arch, name)[1]

    def has(self, name: str) -> bool:
        """Whether the checkpoint stores our parameter ``name``."""
        hf = tensor_names(self.arch, name)[1]
        return hf in self.files or hf[:-len(".weight")] + ".qweight" in self.files

    def weight(self, name: str, exact: bool = False) -> torch.Tensor | QuantizedWeight:
        hf = tensor_names(self.arch, name)[1]
        prefix = hf[:-len(".weight")]
        if self.gptq and prefix + ".qweight" in self.files:
            return self._gptq(prefix)

        def matrix_or_tensor(f):  # one opening of the file: a float matrix stays unread, anything else is read
            header = f.get_slice(hf)
            shape = tuple(header.get_shape())
            if len(shape) == 2 and header.get_dtype() in FLOAT_DTYPES:
                return SafetensorsRows(self, hf, shape)
            return f.get_tensor(hf)

        t = self._read(hf, matrix_or_tensor)
        if isinstance(t, SafetensorsRows):
            return t
        if t.dtype == torch.uint8 and self.packed_ternary:
            return self._ternary(hf, t)
        t = self._float(hf, t)
        if self.arch.hf_norm_shift and name.endswith("norm.weight"):  # stored as w − shift (Gemma's (1 + w))
            t = t.float() + self.arch.hf_norm_shift
        return t

    def _float(self, hf: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` checked to be float and finite, in the file's dtype: users widen what they keep."""
        if not t.is_floating_point():
            raise ModelFormatError(f"{self.path}: tensor {hf} has dtype {t.dtype}, expected a float type")
        if not all_finite(t):
            raise ModelFormatError(f"{self.path}: tensor {hf} contains NaN or inf")
        return t

    def _tensor(self, hf: str) -> torch.Tensor:
        return self._read(hf, lambda f: f.get_tensor(hf))

    def _read(self, hf: str, what):
        """``what(f)`` of the open safetensors file holding ``hf``; its failures name the file and the tensor."""
        file = self.files.get(hf)
        if file is None:
            raise ModelFormatError(f"{self.path}: tensor {hf} is missing")
        from safetensors import safe_open

        try:
            with safe_open(untrusted.require_regular(file), framework="pt") as f:
                return what(f)
        except Exception as e:
            raise ModelFormatError(f"{file}: tensor {hf}: {e}") from None

    def _gptq(self, prefix: str) -> QuantizedWeight:
        from tmac.models.files.gptq import import_gptq

        parts = {}
        for part in ("qweight", "qzeros", "scales", "g_idx"):
            name = f"{prefix}.{part}"
            if name in self.files:
                t = self._tensor(name)
                keep = not t.is_floating_point() or t.dtype in (torch.float16, torch.float32)  # numpy has both
                parts[part] = (t if keep else t.float()).numpy()
            elif part != "g_idx":
                raise ModelFormatError(f"{self.path}: GPTQ tensor {name} is missing")
        try:
            return import_gptq(parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"),
                               self.gptq["bits"], self.gptq["group_size"], self.gptq["version"])
        except ValueError as e:
            raise ModelFormatError(f"{self.path}: GPTQ layer {prefix}: {e}") from None

    def _ternary(self, hf: str, packed: torch.Tensor) -> QuantizedWeight:
        if packed.dim() != 2:
            raise ModelFormatError(f"{self.path}: packed ternary tensor {hf} must be 2-D, got {tuple(packed.shape)}")
        scale = self._tensor(hf + "_scale").float().reshape(-1)
        if scale.numel() != 1 or not torch.isfinite(scale).all() or float(scale[0]) == 0:
            raise ModelFormatError(f"{self.path}: {hf}_scale must be one finite non-zero number")
        p = packed.numpy()
        fields = np.stack([(p >> (2 * i)) & 3 for i in range(4)])  # [4, R, in]: rows r + i·R
        if (fields == 3).any():
            raise ModelFormatError(f"{self.path}: {hf} holds the 2-bit value 3, which is not a ternary w+1")
        codes = fields.reshape(-1, p.shape[1]) + 1  # w + 2: our ternary codes 1..3
        return QuantizedWeight(codes.astype(np.uint8), np.array([[1.0 / float(scale[0])]]), None,
                               WeightFormat.ternary_format(PER_TENSOR))
