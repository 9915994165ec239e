"""Every kernel a model runs on a given ISA: what ``tmac compile --model`` builds ahead of time for a device."""

from __future__ import annotations

import os

from tmac.quant.embedding import StreamedEmbedding
from tmac.base.glue import KV_BLOCK, KV_DTYPES
from tmac.nn.linear import Linear, respec

from tmac.models.family.bitnet import ActivationQuantized
from tmac.models.run.decode import glue_spec

from tmac.models.files.load import load_model
from tmac.models.files.tmac_file import is_tmac_file, load_model_file


def model_kernel_specs(path: str, isa, *, bits: int | None = None, group_size: int | None = None,
                       symmetric: bool = False, head_bits: int | str | None = None) -> list:
    """The ``KernelSpec``s of every LUT projection (head included) and the decode glue (both KV cache dtypes) that
    ``load_model(path, bits=..., ...)`` runs on a machine whose kernels are ``isa``'s — any source ``load_model``
    takes. The model is loaded here (packed for ``isa``; nothing runs), so this costs what a load does."""
    model, converted = _load(path, isa, bits, group_size, symmetric, head_bits)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    # a converted file is packed for the ISA it was converted on: its layers as loading repacks them for ``isa``
    specs = [respec(m.format, m.spec, isa, m.out_features) if converted else m.spec for m in linears]
    if specs:  # the decode plan runs the glue once projections are LUT layers
        act_quant = any(isinstance(m, ActivationQuantized) for m in model.modules())
        # a GGUF's table: read from its blocks, and held as its packed copy (models/files/packed_cache.py) holds it
        helds = (False, True) if isinstance(model.tok_embeddings, StreamedEmbedding) else (False,)
        specs += [glue_spec(model.config, act_quant, isa, kv, model.tok_embeddings, held) for kv in KV_DTYPES
                  for held in helds]
    return list(dict.fromkeys(specs))


def model_formats(path: str, isa, *, bits: int | None = None, group_size: int | None = None,
                  symmetric: bool = False, head_bits: int | str | None = None) -> list:
    """The distinct (``WeightFormat``, K) of every LUT projection ``load_model(path, ...)`` builds: what ``tmac tune
    --model`` times (the same answer as ``model_kernel_specs``: the model is loaded)."""
    model, _ = _load(path, isa, bits, group_size, symmetric, head_bits)
    return list(dict.fromkeys((m.format, m.in_features) for m in model.modules() if isinstance(m, Linear)))


def _load(path, isa, bits, group_size, symmetric, head_bits):
    """The model as ``load_model`` builds it for ``isa`` (a .tmac file as stored), and whether it is a .tmac file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such model file or directory: {path}")
    if os.path.isfile(path) and is_tmac_file(path):
        if bits is not None or group_size is not None or head_bits is not None:
            raise ValueError(f"{path} is already converted (pre-packed); bits/group_size/head_bits do not apply")
        return load_model_file(path), True
    return load_model(path, bits=bits, group_size=group_size, symmetric=symmetric, head_bits=head_bits,
                      isa=isa.name, context=KV_BLOCK), False
