"""Tiny models of every family as transformers builds them (the parity oracle), and the same weights written as
llama.cpp's converter writes GGUF files: tensor names from gguf-py's own name map, metadata keys through its
writer, llama's q/k rows permuted for llama.cpp's RoPE, Gemma's norm weights shifted by one; Gemma's, Phi-3's and
BitNet's with a SentencePiece vocabulary, as theirs are."""
from __future__ import annotations

import functools
import io

import gguf
import numpy as np
import sentencepiece
import torch
import transformers

from tmac.models.family.arch import ARCHITECTURES
from tmac.models.family.llama import LlamaConfig
from tmac.models.files.synthetic import add_llama_metadata

SIZES = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
HEAD_DIM = 32
WINDOW = 8  # positions a sliding layer sees: short, so that the tests' sequences outgrow it
ORIGINAL_CONTEXT = 16  # LongRoPE's short/long boundary


def _longrope() -> dict:
    rng = np.random.default_rng(1)
    half = HEAD_DIM * 3 // 4 // 2  # a partial rotary factor of 3/4, as Phi-4-mini
    return {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": (1 + rng.random(half)).tolist(), "long_factor": (2 + 4 * rng.random(half)).tolist(),
            "original_max_position_embeddings": ORIGINAL_CONTEXT}


def hf_config(family: str):
    """The transformers config of ``family``'s tiny model. ``bitnet`` is BitNet b1.58 2B4T's (squared ReLU),
    ``bitnet-silu`` 1bitLLM's, which llama.cpp's ``bitnet`` architecture computes."""
    if family == "llama":
        return transformers.LlamaConfig(**SIZES, rope_theta=10000.0)
    if family == "mistral":
        return transformers.MistralConfig(**SIZES, head_dim=HEAD_DIM, sliding_window=WINDOW)
    if family == "bitnet":
        return transformers.BitNetConfig(**{**SIZES, "tie_word_embeddings": True}, rope_theta=10000.0)  # (llama.cpp: tied)
    if family == "bitnet-silu":  # (twice the width: TQ2_0 blocks are 256 weights)
        return transformers.BitNetConfig(**{**SIZES, "tie_word_embeddings": True, "hidden_size": 256,
                                            "intermediate_size": 512}, rope_theta=10000.0, hidden_act="silu")
    if family == "qwen2":
        return transformers.Qwen2Config(**SIZES, rope_theta=10000.0)
    if family == "qwen3":
        return transformers.Qwen3Config(**SIZES, head_dim=HEAD_DIM, rope_theta=10000.0)
    if family == "gemma2":  # soft caps small enough to bite on a tiny model's scores and logits
        return transformers.Gemma2Config(**{**SIZES, "tie_word_embeddings": True, "num_hidden_layers": 4},
                                         head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=WINDOW,
                                         attn_logit_softcapping=1.0, final_logit_softcapping=1.0,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                         attn_implementation="eager")
    if family == "gemma3":
        # six layers: llama.cpp's pattern, five sliding and a full one
        return transformers.Gemma3TextConfig(**{**SIZES, "tie_word_embeddings": True, "num_hidden_layers": 6},
                                             head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=WINDOW,
                                             layer_types=["sliding_attention"] * 5 + ["full_attention"],
                                             rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                                    "rope_theta": 10000.0},
                                                              "full_attention": {"rope_type": "default",
                                                                                 "rope_theta": 1000000.0}})
    if family == "phi3":
        return transformers.Phi3Config(**SIZES, pad_token_id=0, rope_parameters=_longrope(),
                                       original_max_position_embeddings=ORIGINAL_CONTEXT)
    if family == "granite":  # multipliers far from 1, so that one left out shows
        return transformers.GraniteConfig(**SIZES, rope_theta=10000.0, embedding_multiplier=6.0,
                                          residual_multiplier=0.3, attention_multiplier=0.05, logits_scaling=4.0)
    if family == "olmo2":
        return transformers.Olmo2Config(**SIZES, rope_theta=10000.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "smollm3":  # eight layers: two of them without RoPE
        return transformers.SmolLM3Config(**{**SIZES, "num_hidden_layers": 8}, rope_theta=10000.0, pad_token_id=0,
                                          bos_token_id=1, eos_token_id=2)
    raise ValueError(family)


CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "bitnet": "BitNetForCausalLM",
           "bitnet-silu": "BitNetForCausalLM",
           "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
           "gemma3": "Gemma3ForCausalLM",
           "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM",
           "smollm3": "SmolLM3ForCausalLM"}
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "bitnet": "bitnet", "bitnet-silu": "bitnet", "qwen2": "qwen2", "qwen3": "qwen3",
             "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "granite": "granite", "olmo2": "olmo2",
             "smollm3": "smollm3"}


def hf_model(family: str, seed: int = 0):
    """``family``'s tiny model, random; norms random too (their init is all ones, or zeros for Gemma's 1 + w),
    so that a norm read wrongly shows."""
    torch.manual_seed(seed)
    model = getattr(transformers, CLASSES[family])(hf_config(family)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p) if not family.startswith("gemma") else 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows from "rotate half" to interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _sub_norm(hf: str) -> str | None:
    """BitNet b1.58 2B4T's sub-norm names, which gguf-py's map (made for 1bitLLM's) lacks, as GGUF names."""
    for theirs, tensor in (("self_attn.attn_sub_norm", gguf.MODEL_TENSOR.ATTN_SUB_NORM),
                           ("mlp.ffn_sub_norm", gguf.MODEL_TENSOR.FFN_SUB_NORM)):
        if hf.endswith(f"{theirs}.weight"):
            return gguf.TENSOR_NAMES[tensor].format(bid=int(hf.split(".")[2])) + ".weight"
    return None


# the families whose GGUFs carry a SentencePiece vocabulary, and whether llama.cpp's converter sets its space prefix
SENTENCEPIECE = {"gemma2": False, "gemma3": False, "phi3": True, "bitnet": True, "bitnet-silu": True}
CORPUS = ("the quick brown fox jumps over the lazy dog", "hello world, hello there", "a hello to the world",
          "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex.")


@functools.lru_cache(maxsize=None)
def sentencepiece_vocabulary(vocab_size: int, space_prefix: bool, special: tuple[str, ...] = (),
                             corpus: tuple[str, ...] = CORPUS):
    """A SentencePiece BPE model trained on ``corpus`` (byte fallback, no normalization: Llama's and Gemma's
    settings), and its GGUF tokenizer metadata as llama.cpp's converter writes it."""
    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus * 4), model_writer=proto, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=space_prefix, hard_vocab_limit=False, user_defined_symbols=list(special), minloglevel=2)
    sp = sentencepiece.SentencePieceProcessor(model_proto=proto.getvalue())
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]

    def kind(i):  # llama.cpp's token types
        return (2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 5 if sp.is_unused(i)
                else 4 if tokens[i] in special else 1)

    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [sp.get_score(i) for i in range(len(tokens))],
            "tokenizer.ggml.token_type": [kind(i) for i in range(len(tokens))],
            "tokenizer.ggml.bos_token_id": sp.bos_id(), "tokenizer.ggml.eos_token_id": sp.eos_id(),
            "tokenizer.ggml.unknown_token_id": sp.unk_id(), "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_space_prefix": space_prefix}
    return sp, meta


def _add_sentencepiece(w, meta: dict) -> None:
    w.add_tokenizer_model("llama")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_scores(meta["tokenizer.ggml.scores"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_unk_token_id(meta["tokenizer.ggml.unknown_token_id"])
    w.add_add_bos_token(True)
    w.add_add_space_prefix(meta["tokenizer.ggml.add_space_prefix"])


def write_gguf(model, family: str, path, weight_type: str = "F32") -> dict:
    """``model``'s weights as a GGUF of ``family``'s architecture, its matrices in ``weight_type`` (ternary types:
    the projections only, the token table F16, as BitNet conversions have it). Returns the weights the file holds,
    dequantized, by their Hugging Face names: the exact model of the file."""
    c = model.config
    arch = GGUF_ARCH[family]
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w = gguf.GGUFWriter(str(path), arch)
    add_llama_metadata(w, LlamaConfig(vocab_size=c.vocab_size, dim=c.hidden_size, n_layers=c.num_hidden_layers,
                                      n_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads,
                                      ffn_dim=c.intermediate_size, norm_eps=c.rms_norm_eps,
                                      rope_theta=rope["rope_theta"], context_length=c.max_position_embeddings),
                       tokenizer=family not in SENTENCEPIECE)
    if family in SENTENCEPIECE:
        _add_sentencepiece(w, sentencepiece_vocabulary(c.vocab_size, SENTENCEPIECE[family])[1])
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if family in ("gemma2", "gemma3"):
        w.add_sliding_window(c.sliding_window)
    if family == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if family == "granite":
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_attention_scale(c.attention_multiplier)
        w.add_logit_scale(c.logits_scaling)
    if family == "phi3":
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(c.max_position_embeddings / ORIGINAL_CONTEXT)
                                                      / np.log(ORIGINAL_CONTEXT))))
        w.add_rope_scaling_orig_ctx_len(ORIGINAL_CONTEXT)
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    held = {}
    for hf, t in model.state_dict().items():
        if hf == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name = names.get_name(hf, try_suffixes=(".weight", ".bias")) or _sub_norm(hf)
        if name is None:
            raise KeyError(f"gguf-py maps no tensor to {hf}")
        t = t.detach().float().numpy()
        kind = weight_type if t.ndim == 2 else "F32"
        if kind.startswith("TQ") and not name.startswith("blk."):
            kind = "F16"
        if kind in ("F32", "F16"):
            held[hf] = torch.from_numpy(t.astype(np.float16 if kind == "F16" else np.float32).astype(np.float32))
        else:  # a quantized row depends on that row only: the permutation below commutes with it
            qtype = gguf.GGMLQuantizationType[kind]
            held[hf] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(t), qtype),
                                                               qtype).reshape(t.shape))
        if family.startswith("gemma") and hf.endswith("norm.weight"):
            t = t + 1  # llama.cpp's converter: Gemma's (1 + w) stored as the weight
        if ARCHITECTURES[arch].gguf_interleaved_qk and name.endswith(("attn_q.weight", "attn_k.weight")):
            t = _permute(t, c.num_attention_heads if "attn_q" in name else c.num_key_value_heads)
        if kind in ("F32", "F16"):
            w.add_tensor(name, np.ascontiguousarray(t, np.float16 if kind == "F16" else np.float32))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(t), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held
