"""``.tmac`` files: a converted model, pre-packed — safetensors tensors plus JSON metadata (config, module
structure, tokenizer, chat template). Loading rebuilds the model on the meta device and fills it with the
stored tensors; nothing is requantized, and packing is redone only for another ISA or tiling.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tmac.errors import ModelFormatError
from tmac.serialize import load, read_model_info, save

from .bitnet import ActivationQuantized, BitNetTransformer
from .llama import LlamaConfig, Transformer
from .tokenizer import Tokenizer

FORMAT_VERSION = 1


class Concat(nn.Module):
    """Layers run on the same input, outputs concatenated: a fused projection whose parts differ in format."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x):
        return torch.cat([p(x) for p in self.parts], dim=-1)


def save_model(model: Transformer, path: str) -> None:
    wrappers = {}
    for name, module in model.named_modules():
        if isinstance(module, ActivationQuantized):
            wrappers[name] = "activation_quantized"
        elif isinstance(module, Concat):
            wrappers[name] = f"concat:{len(module.parts)}"
    tok = model.tokenizer
    info = {"version": FORMAT_VERSION, "family": "bitnet" if isinstance(model, BitNetTransformer) else "llama",
            "config": dataclasses.asdict(model.config), "wrappers": wrappers,
            "tokenizer": None if tok is None else {
                "json": tok.backend.to_str(), "bos_id": tok.bos_id, "eos_id": tok.eos_id, "add_bos": tok.add_bos,
                "chat_template": tok.chat_template, "stop_ids": sorted(tok.stop_ids)}}
    save(model, path, info)


def is_tmac_file(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{" and read_model_info(path) is not None


def load_model_file(path: str) -> Transformer:
    info = read_model_info(path)
    try:
        if info.get("version") != FORMAT_VERSION:
            raise ValueError(f"format version {info.get('version')!r}, this tmac reads {FORMAT_VERSION}")
        cfg = LlamaConfig(**info["config"])
        family, wrappers = info["family"], info["wrappers"]
        if family not in ("llama", "bitnet") or not isinstance(wrappers, dict):
            raise ValueError(f"unknown family {family!r} or malformed wrappers")
        model = (BitNetTransformer if family == "bitnet" else Transformer).skeleton(cfg)
        with torch.device("meta"):
            for name, kind in sorted(wrappers.items(), key=lambda kv: kv[0].count(".")):
                parent, _, child = name.rpartition(".")
                inner = getattr(model.get_submodule(parent), child)
                if kind == "activation_quantized":
                    layer = ActivationQuantized(inner)
                elif isinstance(kind, str) and kind.startswith("concat:") and kind[7:].isdigit():
                    layer = Concat([nn.Linear(1, 1, bias=False) for _ in range(int(kind[7:]))])
                else:
                    raise ValueError(f"unknown wrapper {kind!r} at {name}")
                setattr(model.get_submodule(parent), child, layer)
        tok = info["tokenizer"]
        tokenizer = None if tok is None else _tokenizer(tok)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ModelFormatError(f"{path}: malformed tmac model metadata ({type(e).__name__}: {e})") from None
    load(path, model)
    model.tokenizer = tokenizer
    model.source = path
    return model


def _tokenizer(tok: dict) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    try:
        backend = HFTokenizer.from_str(tok["json"])
    except Exception as e:  # tokenizers raises a bare Exception for malformed JSON
        raise ValueError(f"tokenizer: {e}") from None
    return Tokenizer(backend, tok["bos_id"], tok["eos_id"], bool(tok["add_bos"]),
                     tok["chat_template"], frozenset(int(i) for i in tok["stop_ids"]))
