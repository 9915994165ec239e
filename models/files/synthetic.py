"""Seeded random GGUF files of any supported family (``tmac.models.family.arch``): benchmark models of real shapes without
downloading any, and small models for tests. tmac and llama.cpp read the very same file, so their speeds compare
like for like.

The tokenizer is a byte-level BPE (GPT-2's 256 byte tokens, a few merges, filler tokens up to the vocabulary
size and an end-of-text token), enough for both to tokenize and generate; or a real model's, copied from its GGUF
(``tokenizer_from``), so that a prompt is as many tokens as a real model makes of it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from tmac.models.family.llama import LlamaConfig


def layer_tensors(arch, cfg: LlamaConfig) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """One layer's tensors of family ``arch`` (a ``tmac.models.family.arch`` record) at ``cfg``'s sizes, as the record names
    them (q|k|v and gate|up as one tensor each where the family stores them fused): ours → (GGUF name, Hugging
    Face name, shape), the shapes the loaders check (``expected_shape`` of the config the family's flags make)."""
    from tmac.models.family.arch import FUSED, FUSED_NAMES
    from tmac.models.family.llama import expected_shape

    cfg = dataclasses.replace(cfg, **arch.config_flags())
    table = arch.layer_tensors()
    if arch.fused:
        for fused, parts in FUSED.items():
            for part in parts:
                del table[part]
            table[fused] = FUSED_NAMES[fused]
    return {ours: (gguf, hf, expected_shape(cfg, f"layers.0.{ours}")) for ours, (gguf, hf) in table.items()}


SLIDING_WINDOW = 512  # Gemma 3's


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: the 256 single-byte tokens of a byte-level BPE."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    extra = [b for b in range(256) if b not in keep]
    chars = {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(extra)}
    return [chars[b] for b in range(256)]


def k_quant_blocks(rng: np.random.Generator, rows: int, k: int, type_name: str = "Q4_K") -> np.ndarray:
    """Random ``type_name`` blocks (one of ``K_QUANT_TYPES``; gguf-py quantizes none of them) ``[rows, k/256·bytes]``
    (uint8) of weights about N(0, 0.02)'s size (layouts: ``tmac.base.formats``). Q4_K/Q5_K: d·a·q − dmin·b with 6-bit a,
    b from 16 to 63, as llama.cpp's quantizer spreads them over most of their range; Q2_K: 4-bit a, b from 4 to 15;
    Q3_K: d·(a − 32)·(q − 4) with a of 6 bits; Q6_K: d·sc·(q − 32) with int8 sc of either sign. The codebook types
    (``CODEBOOK_TYPES``): ``codebook_blocks``."""
    n = rows * k // 256

    def f16(lo, hi):
        return rng.uniform(lo, hi, n).astype(np.float16).view(np.uint8).reshape(n, 2)

    def uniform_bytes(count, lo=0, hi=256):
        return rng.integers(lo, hi, (n, count), dtype=np.uint8)

    if type_name in CODEBOOK_TYPES + GRID_TYPES:
        return codebook_blocks(rng, rows, k, type_name)
    if type_name == "Q6_K":  # {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}
        sc = (rng.integers(16, 128, (n, 16)) * rng.choice([-1, 1], (n, 16))).astype(np.int8)
        blocks = [uniform_bytes(192), sc.view(np.uint8), f16(1.5e-5, 3e-5)]
    elif type_name == "Q3_K":  # {u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d}: every byte of the scales is bits
        blocks = [uniform_bytes(108), f16(5e-4, 1e-3)]
    elif type_name == "Q2_K":  # {u8 scales[16]; u8 qs[64]; f16 d; f16 dmin}
        sc = uniform_bytes(16, 4, 16) | uniform_bytes(16, 4, 16) << 4
        blocks = [sc, uniform_bytes(64), f16(1e-3, 2e-3), f16(2e-3, 4e-3)]
    else:
        high = {"Q4_K": 0, "Q5_K": 32}[type_name]  # Q5_K: the fifth bits, 32 bytes before the nibbles
        scale = 2 ** -(high // 32)  # codes twice as large at 5 bits: weights of the same size
        a, b = uniform_bytes(8, 16, 64), uniform_bytes(8, 16, 64)
        # bytes 0-3: a0-a3 and the top 2 bits of a4-a7; 4-7: the same for b; 8-11: low nibbles of a4-a7 | b4-b7
        packed = np.concatenate([a[:, :4] | (a[:, 4:] >> 4) << 6, b[:, :4] | (b[:, 4:] >> 4) << 6,
                                 (a[:, 4:] & 15) | (b[:, 4:] & 15) << 4], axis=1)
        blocks = [f16(1e-4 * scale, 2e-4 * scale), f16(5e-4, 1e-3), packed, uniform_bytes(high + 128)]
    return np.concatenate(blocks, axis=1).reshape(rows, -1)


def codebook_blocks(rng: np.random.Generator, rows: int, k: int, type_name: str) -> np.ndarray:
    """Random blocks of a codebook type ``[rows, k/block·bytes]`` of weights about N(0, 0.02)'s size: IQ4_NL
    d·level[q] (its levels reach ±127); IQ4_XS d·(a − 32)·level[q] with 6-bit a of either sign of a − 32; the grid
    types (``GRID_TYPES``): ``_grid_blocks``."""
    block = 32 if type_name == "IQ4_NL" else 256
    n = rows * k // block

    def f16(lo, hi):
        return rng.uniform(lo, hi, n).astype(np.float16).view(np.uint8).reshape(n, 2)

    if type_name in GRID_TYPES:
        return _grid_blocks(rng, rows, k, type_name)
    codes = rng.integers(0, 256, (n, block // 2), dtype=np.uint8)
    if type_name == "IQ4_NL":  # {f16 d; u8 qs[16]}
        return np.concatenate([f16(2e-4, 4e-4), codes], axis=1).reshape(rows, -1)
    a = (32 + rng.integers(8, 32, (n, 8)) * rng.choice([-1, 1], (n, 8))).astype(np.uint16)  # {f16 d; u16 sh;
    high = ((a >> 4) << np.arange(0, 16, 2, dtype=np.uint16)).sum(axis=1, dtype=np.uint16)  # u8 sl[4]; u8 qs[128]}
    low = (a[:, 0::2] & 15 | (a[:, 1::2] & 15) << 4).astype(np.uint8)
    return np.concatenate([f16(1e-5, 2e-5), high[:, None].view(np.uint8), low, codes], axis=1).reshape(rows, -1)


# the grid i-quants: every index, sign and scale bit pattern is a valid block, so random bytes are, with a float16 d
# (for IQ1_M: the top nibbles of its four scale words) that brings the weights to N(0, 0.02)'s size
GRID_D = {"IQ2_XXS": 4e-4, "IQ2_XS": 4e-4, "IQ2_S": 4e-4, "IQ3_XXS": 1.5e-4, "IQ3_S": 1.5e-4, "IQ1_S": 3e-3,
          "IQ1_M": 3e-3}
GRID_TYPES = tuple(GRID_D)


def _grid_blocks(rng: np.random.Generator, rows: int, k: int, type_name: str) -> np.ndarray:
    from tmac.base.formats import GGUF_EXACT

    n, size = rows * k // 256, GGUF_EXACT[type_name].gguf.type_size
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    d = rng.uniform(GRID_D[type_name], 2 * GRID_D[type_name], n).astype(np.float16).view(np.uint16)
    if type_name == "IQ1_M":  # {u8 qs[32]; u8 qh[16]; u16 sc[4]}: d's nibble i in bits 12-15 of sc[i]
        sc = blocks[:, 48:56].copy().view("<u2")
        for i in range(4):
            sc[:, i] = (sc[:, i] & 0x0FFF) | (((d >> (4 * i)) & 0xF) << 12)
        blocks[:, 48:56] = sc.view(np.uint8)
    else:
        blocks[:, :2] = d[:, None].view(np.uint8)
    return blocks.reshape(rows, -1)


K_QUANT_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# imported as codebook codes (IQ1_S, a grid type too, is a K-quant of 2-bit codes: tmac.base.formats)
CODEBOOK_TYPES = ("IQ4_NL", "IQ4_XS") + tuple(t for t in GRID_TYPES if t != "IQ1_S")
TERNARY_TYPES = ("TQ1_0", "TQ2_0")
TERNARY_SCALE = 0.0200042724609375  # a float16 value, so every block's d holds it exactly


def add_llama_metadata(w, cfg: LlamaConfig, tokenizer: bool = True) -> None:
    """A llama GGUF's metadata for ``cfg`` on writer ``w``, with (unless not ``tokenizer``) a byte-level BPE
    tokenizer of ``cfg.vocab_size`` tokens (the 256 bytes, "he", "ll", "hell", fillers, and an end-of-text token)
    and a plain chat template."""
    if tokenizer and cfg.vocab_size < 260:
        raise ValueError(f"vocab_size={cfg.vocab_size}: a byte-level tokenizer needs at least 260 tokens")
    tokens = byte_tokens() + ["he", "ll", "hell"]
    tokens += [f"<filler{i}>" for i in range(cfg.vocab_size - len(tokens) - 1)] + ["<|endoftext|>"]
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.dim)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    if not tokenizer:
        return
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # the name llama.cpp knows the GPT-2 pre-tokenizer by
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_token_merges(["h e", "l l", "he ll"])
    w.add_eos_token_id(len(tokens) - 1)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")


def copy_tokenizer(w, source: str, vocab_size: int) -> None:
    """The ``tokenizer.*`` metadata of the GGUF ``source`` (its vocabulary, merges, special tokens and chat
    template) on writer ``w``; its vocabulary must have ``vocab_size`` tokens."""
    import gguf

    reader = gguf.GGUFReader(source)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None or len(tokens.data) != vocab_size:
        raise ValueError(f"{source}: tokenizer.ggml.tokens has {'no' if tokens is None else len(tokens.data)} "
                         f"tokens, the model {vocab_size}")
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), field.types[0], sub_type)


def write_random_gguf(path: str, cfg: LlamaConfig, weight_type: str | Callable[[str], str] = "Q4_0",
                      seed: int = 0, progress: Callable[[str], object] | None = None, family: str = "llama",
                      tokenizer_from: str | None = None) -> None:
    """Write a GGUF of ``family`` (a ``tmac.models.family.arch`` record) and shape ``cfg`` whose matrices hold N(0, 0.02)
    weights in ``weight_type`` (a GGML type name, or a function of the GGUF tensor name giving one), norms F32 ones
    and biases F32 zeros. Ternary types get uniformly random ternary weights times one per-tensor scale, as
    converted BitNet models have. ``tokenizer_from``: a GGUF whose tokenizer the file takes (``copy_tokenizer``)
    instead of the byte-level one."""
    import gguf

    from tmac.models.family.arch import ARCHITECTURES

    arch = ARCHITECTURES[family]
    type_of = weight_type if callable(weight_type) else (lambda name: weight_type)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch.gguf)
    add_llama_metadata(w, cfg, tokenizer=tokenizer_from is None)
    if tokenizer_from is not None:
        copy_tokenizer(w, tokenizer_from, cfg.vocab_size)
    if arch.gguf_swa_every:
        w.add_sliding_window(SLIDING_WINDOW)
    for field, value in arch.typical.items():  # the family's own scalars, as its real files have them
        w.add_float32(f"{arch.gguf}.{arch.gguf_keys[field]}", value)

    def add(name: str, shape: tuple[int, ...]) -> None:
        kind = type_of(name) if len(shape) == 2 else "F32"
        if len(shape) == 1:
            data = np.zeros(shape, np.float32) if name.endswith(".bias") else np.ones(shape, np.float32)
        elif kind in TERNARY_TYPES:  # as BitNet conversions hold them: ternary, one scale repeated in every block
            data = (rng.integers(-1, 2, shape) * TERNARY_SCALE).astype(np.float32)
        else:
            data = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in ("F32", "F16"):
            w.add_tensor(name, data.astype(np.float16 if kind == "F16" else np.float32))
        elif kind in K_QUANT_TYPES + CODEBOOK_TYPES + GRID_TYPES:  # gguf-py quantizes none: random blocks of the same magnitude
            w.add_tensor(name, k_quant_blocks(rng, *shape, kind), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        if progress:
            progress(name)

    add("token_embd.weight", (cfg.vocab_size, cfg.dim))
    add("output_norm.weight", (cfg.dim,))
    if not cfg.tie_embeddings:
        add("output.weight", (cfg.vocab_size, cfg.dim))
    tensors = sorted(layer_tensors(arch, cfg).values(), key=lambda t: len(t[2]))  # (a layer's vectors first)
    for i in range(cfg.n_layers):
        for name, _, shape in tensors:
            add(f"blk.{i}.{name}", shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_random_bitnet_dir(path: str, cfg: LlamaConfig, seed: int = 0,
                            progress: Callable[[str], object] | None = None) -> None:
    """Write a Hugging Face BitNet b1.58 directory of shape ``cfg`` in the packed ternary ("offline" bitlinear)
    layout: uniformly random ternary projections with a per-tensor ``weight_scale``, float16 embedding and head.
    Real BitNet shapes (hidden 3200) are not multiples of llama.cpp's 256-blocks, so this is tmac's own case."""
    import json
    import os

    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    os.makedirs(path, exist_ok=True)
    config = {"architectures": ["BitNetForCausalLM"], "model_type": "bitnet", "hidden_act": "relu2",
              "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
              "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
              "num_key_value_heads": cfg.n_kv_heads, "max_position_embeddings": cfg.context_length,
              "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "tie_word_embeddings": False,
              "quantization_config": {"quant_method": "bitnet", "linear_class": "bitlinear",
                                      "quantization_mode": "offline"}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    tensors = {"model.embed_tokens.weight": (rng.standard_normal((cfg.vocab_size, cfg.dim), np.float32) * 0.02
                                             ).astype(np.float16),
               "lm_head.weight": (rng.standard_normal((cfg.vocab_size, cfg.dim), np.float32) * 0.02).astype(np.float16),
               "model.norm.weight": np.ones(cfg.dim, np.float16)}
    from tmac.models.family.arch import ARCHITECTURES

    layers = layer_tensors(ARCHITECTURES["bitnet"], cfg).values()
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        for _, name, shape in layers:
            if len(shape) == 1:
                tensors[p + name] = np.ones(shape, np.float16)
                continue
            rows, cols = shape
            fields = rng.integers(0, 3, (4, rows // 4, cols), dtype=np.uint8)  # w + 1, four rows per byte
            tensors[p + name] = fields[0] | fields[1] << 2 | fields[2] << 4 | fields[3] << 6
            tensors[p + name.removesuffix(".weight") + ".weight_scale"] = np.array([40.0], np.float32)
        if progress:
            progress(f"layer {i}")
    save_file(tensors, os.path.join(path, "model.safetensors"))
