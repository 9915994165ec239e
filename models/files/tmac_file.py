"""``.tmac`` files: a converted model, pre-packed — safetensors tensors plus JSON metadata (config, module
structure, tokenizer, chat template). Loading rebuilds the model on the meta device and fills it with the
stored tensors; nothing is requantized, and packing is redone only for another ISA or tiling.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from tmac.base import files
from tmac.base.errors import ModelFormatError
from tmac.quant.embedding import Embedding
from tmac.base.float_linear import FloatLinear
from tmac.nn.linear import Linear
from tmac.base.memory import release_freed_memory
from tmac.execution.packing import unpack_by_rows
from tmac.nn.serialize import load, read_model_info, save

from tmac.models.family.arch import ARCHITECTURES, FUSED
from tmac.models.family.bitnet import ActivationQuantized
from tmac.models.family.llama import Concat, LlamaConfig, Transformer, expected_shape
from tmac.models.text.tokenizer import pack_text, tokenizer_from_info

FORMAT_VERSION = 1
MAX_CONCAT = 8  # parts of one fused projection (q|k|v is 3): a count from a file is untrusted


def save_model(model: Transformer, path: str, shared_table: bool = False) -> bool:
    """Write ``model`` to ``path``; returns whether its token table was stored as the head's. A token table is stored
    as its own tensors, which stay in the mapped file until their rows are looked up; with ``shared_table``, a tied
    table that holds exactly the head's weights (``shares_table``) is stored once, as the head — a smaller file,
    whose load unpacks the table from the head into memory of its own."""
    wrappers = {}
    for name, module in model.named_modules():
        if isinstance(module, ActivationQuantized):
            wrappers[name] = "activation_quantized"
        elif isinstance(module, Concat):
            wrappers[name] = f"concat:{len(module.parts)}"
    tok = model.tokenizer
    shared = shared_table and shares_table(model)
    info = {"version": FORMAT_VERSION, "family": model.config.family,
            "config": dataclasses.asdict(model.config), "wrappers": wrappers, "table_from_head": shared,
            "file_quantization": getattr(model, "file_quantization", None),
            "tokenizer": None if tok is None else {
                "json_z64": pack_text(tok.backend.to_str()), "bos_id": tok.bos_id, "eos_id": tok.eos_id, "add_bos": tok.add_bos,
                "chat_template": tok.chat_template, "stop_ids": sorted(tok.stop_ids)}}
    table = model.tok_embeddings
    if shared:  # a tied table is the head's weights again: stored once, as the head (rebuilt from it on load)
        model.tok_embeddings = nn.Identity()
    try:
        save(model, path, info)
    finally:
        model.tok_embeddings = table
    return shared


def shares_table(model: Transformer) -> bool:
    """Whether the token table holds exactly the head's quantized weights (a tied quantized table)."""
    emb, head = model.tok_embeddings, model.output
    if not (model.config.tie_embeddings and isinstance(emb, Embedding) and isinstance(head, Linear) and
            emb.format == head.format and (emb.num_embeddings, emb.embedding_dim) == (head.out_features,
                                                                                     head.in_features)):
        return False
    again = Embedding(head.quantized_weight())  # (at conversion only: the load rebuilds the table the same way)
    return all(torch.equal(getattr(emb, n), getattr(again, n)) if getattr(emb, n) is not None else
               getattr(again, n) is None for n in ("codes", "scales", "zeros"))


def is_tmac_file(path: str) -> bool:
    with open(files.require_regular(path), "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{" and read_model_info(path) is not None


def load_model_file(path: str, mmap: bool = True) -> Transformer:
    info = read_model_info(path)
    try:
        if info.get("version") != FORMAT_VERSION:
            raise ValueError(f"format version {info.get('version')!r}, this tmac reads {FORMAT_VERSION}")
        family, wrappers, config = info["family"], info["wrappers"], info["config"]
        if family not in ARCHITECTURES or not isinstance(wrappers, dict) or not isinstance(config, dict):
            raise ValueError(f"unknown family {family!r:.40}, or malformed wrappers or config")
        if family == "bitnet" and "sub_norms" not in config:  # written before the config described BitNet
            config = {**config, "activation": "relu2", "sub_norms": True}
        config = {"arch": family, **config}  # written before the config named its architecture
        cfg = LlamaConfig(**config)
        if cfg.family != family:
            raise ValueError(f"family {family!r} but a config of the {cfg.family} family")
        model = Transformer.skeleton(cfg)
        with torch.device("meta"):
            for name, kind in sorted(wrappers.items(), key=lambda kv: kv[0].count(".")):
                parent, _, child = name.rpartition(".")
                inner = getattr(model.get_submodule(parent), child)
                if kind == "activation_quantized":
                    layer = ActivationQuantized(inner)
                elif isinstance(kind, str) and kind.startswith("concat:") and kind[7:].isdigit() \
                        and 1 <= int(kind[7:]) <= MAX_CONCAT:
                    layer = Concat(_concat_parts(cfg, name, int(kind[7:])))
                else:
                    raise ValueError(f"unknown wrapper {kind!r} at {name}")
                setattr(model.get_submodule(parent), child, layer)
        tok = info["tokenizer"]
        tokenizer = None if tok is None else tokenizer_from_info(tok, path)
        release_freed_memory()  # what building the tokenizer parsed, before the tensors' pages come in
        table_from_head = info.get("table_from_head", False)
        if type(table_from_head) is not bool:
            raise ValueError(f"table_from_head={table_from_head!r:.20}")
        file_quantization = info.get("file_quantization")  # (the GGUF's types; absent from older files)
        if file_quantization is not None and not (isinstance(file_quantization, str) and
                                                  re.fullmatch(r"[A-Z0-9_]{1,16}(\+[A-Z0-9_]{1,16}){0,15}",
                                                               file_quantization)):
            raise ValueError(f"file_quantization={file_quantization!r:.40}")
        if table_from_head:
            model.tok_embeddings = nn.Identity()
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ModelFormatError(f"{path}: malformed tmac model metadata ({type(e).__name__}: {e})") from None
    load(path, model, mmap=mmap)
    if table_from_head:
        if not isinstance(model.output, Linear):
            raise ModelFormatError(f"{path}: table_from_head, but the head is not a quantized layer")
        release_freed_memory()  # (the load's temporaries, before the table grows)
        model.tok_embeddings = Embedding(unpack_by_rows(model.output.packed(), model.output.format))
    try:
        check_structure(model)
    except ValueError as e:
        raise ModelFormatError(f"{path}: {e}") from None
    model.tokenizer = tokenizer
    model.source, model.file_quantization = path, file_quantization
    return model


def _concat_parts(cfg: LlamaConfig, name: str, count: int) -> list[nn.Module]:
    """Placeholders for the ``count`` parts of fused projection ``name`` (``layers.3.attention.wqkv``), shaped as
    the config says each is (q, k, v; gate, up): a part the file stores quantized replaces its placeholder with a
    layer of the file's own type, whose rows are checked against it (a Q4_K q beside a Q6_K v)."""
    layer, _, fused = name.partition(".")[2].partition(".")
    parts = PROJECTIONS.get(fused)
    if not name.startswith("layers.") or parts is None or count != len(parts):
        raise ValueError(f"concat:{count} at {name}: not a fused projection of {len(parts or ())} parts")
    shapes = [expected_shape(cfg, f"layers.{layer}.{p}") for p in parts]
    bias = cfg.qkv_bias and fused == "attention.wqkv"
    return [FloatLinear(k, m, bias=bias) for m, k in shapes]


# every projection module → the unfused weights whose rows it stacks
PROJECTIONS = {**{name.removesuffix(".weight"): parts for name, parts in FUSED.items()},
               "attention.wo": ("attention.wo.weight",), "feed_forward.w2": ("feed_forward.w2.weight",)}


def features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a projection as the model holds it: a linear layer, maybe wrapped or concatenated."""
    if isinstance(module, ActivationQuantized):
        return features(module.linear)
    if isinstance(module, Concat):
        parts = [features(p) for p in module.parts]
        if len({i for i, _ in parts}) != 1:
            raise ValueError(f"the parts of a fused projection take different inputs: {parts}")
        return parts[0][0], sum(o for _, o in parts)
    return module.in_features, module.out_features


def check_structure(model: Transformer) -> None:
    """The loaded layers and parameters have the shapes the config implies: a file's tensors may disagree with
    its config, and the model would only fail (or compute garbage) at the first forward."""
    cfg = model.config
    problems = []
    for name, param in model.named_parameters():
        try:
            want = expected_shape(cfg, name)
        except KeyError:
            continue  # a weight inside a projection: checked below as the projection's features
        if tuple(param.shape) != want:
            problems.append(f"{name} has shape {tuple(param.shape)}, the config implies {want}")
    for i, layer in enumerate(model.layers):
        for fused, parts in PROJECTIONS.items():
            shapes = [expected_shape(cfg, f"layers.{i}.{p}") for p in parts]
            want = (shapes[0][1], sum(s[0] for s in shapes))
            got = features(layer.get_submodule(fused))
            if got != want:
                problems.append(f"layers.{i}.{fused} maps {got[0]} → {got[1]} features, the config implies "
                                f"{want[0]} → {want[1]}")
    if features(model.output) != (cfg.dim, cfg.vocab_size):
        problems.append(f"output head maps {features(model.output)}, the config implies {(cfg.dim, cfg.vocab_size)}")
    if problems:
        raise ValueError("; ".join(problems[:3]))
