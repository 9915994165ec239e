"""Llama 3.1 / 3.2 RoPE scaling from a GGUF: llama.cpp's converter stores it as ``rope_freqs.weight`` (a divisor for
each frequency). The oracle is transformers' ``LlamaForCausalLM`` with ``rope_scaling`` of type llama3; its weights
are written as llama.cpp's converter writes them (GGUF names, q/k rows permuted for llama.cpp's RoPE, the factors
computed from the config as the converter does), in float32."""
import math

import gguf
import numpy as np
import pytest
import torch
import transformers

import tmac
from tmac.models.family.llama import LlamaConfig
from tmac.models.files.synthetic import add_llama_metadata

SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16}  # small, so that positions past 16 feel the scaling


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      rope_theta=500000.0, rope_scaling=dict(SCALING), tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).eval()


def _llama_cpp_rope_factors(config) -> np.ndarray:
    """What convert_hf_to_gguf.py stores as rope_freqs.weight for a llama3 rope_scaling."""
    head_dim = config.hidden_size // config.num_attention_heads
    s = config.rope_scaling  # (transformers 5 keeps rope_theta in it too)
    freqs = 1.0 / (s["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / \
                (s["high_freq_factor"] - s["low_freq_factor"])
            factors.append(1.0 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows from "rotate half" to interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(model, path, with_factors: bool = True) -> None:
    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    add_llama_metadata(w, LlamaConfig(vocab_size=c.vocab_size, dim=c.hidden_size, n_layers=c.num_hidden_layers,
                                      n_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads,
                                      ffn_dim=c.intermediate_size, norm_eps=c.rms_norm_eps,
                                      rope_theta=c.rope_scaling["rope_theta"], context_length=c.max_position_embeddings))
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    if with_factors:
        w.add_tensor("rope_freqs.weight", _llama_cpp_rope_factors(c))
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(c.num_hidden_layers):
        for ours, theirs in names.items():
            t = sd[f"model.layers.{i}.{ours}.weight"]
            if theirs in ("attn_q", "attn_k"):
                t = _permute(t, c.num_attention_heads if theirs == "attn_q" else c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{theirs}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_llama3_scaled_gguf_gives_transformers_logits_and_greedy_ids(hf_model, tmp_path):
    path = tmp_path / "llama3.gguf"
    _write_gguf(hf_model, path)
    ids = torch.randint(0, 300, (48,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf_model(ids[None]).logits[0].double()
    model = tmac.load_model(str(path), kv_dtype="float32", progress=False)
    assert model.config.rope_factors is not None and not any(isinstance(m, tmac.Linear) for m in model.modules())
    got = tmac.Session(model).logits(ids.tolist()).double()
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())
    with torch.no_grad():
        hf_ids = hf_model.generate(ids[None, :16], max_new_tokens=32, do_sample=False)[0, 16:].tolist()
    assert tmac.Session(model).generate(ids[:16].tolist(), max_new_tokens=32, ignore_eos=True, temperature=0) == hf_ids
    # the factors matter past the original 16 positions: without them the logits there are another model's
    _write_gguf(hf_model, tmp_path / "plain.gguf", with_factors=False)
    plain = tmac.Session(tmac.load_model(str(tmp_path / "plain.gguf"), kv_dtype="float32", progress=False))
    assert float((plain.logits(ids.tolist()).double() - want)[24:].abs().max()) > 100 * float((got - want).abs().max())


def test_quantized_and_converted_the_factors_travel(hf_model, tmp_path):
    """Requantized to 4 bits and converted to .tmac, the model keeps its factors: the same greedy ids either way."""
    path = tmp_path / "llama3.gguf"
    _write_gguf(hf_model, path)
    prompt = list(range(5, 37))
    quantized = tmac.load_model(str(path), bits=4, group_size=32, progress=False)
    want = tmac.Session(quantized).generate(prompt, max_new_tokens=12, ignore_eos=True, temperature=0)
    from tmac.models.files.tmac_file import save_model

    save_model(quantized, str(tmp_path / "llama3.tmac"))
    converted = tmac.load_model(str(tmp_path / "llama3.tmac"), progress=False)
    assert converted.config.rope_factors == quantized.config.rope_factors
    assert tmac.Session(converted).generate(prompt, max_new_tokens=12, ignore_eos=True, temperature=0) == want


def test_rope_factors_of_the_wrong_count_or_sign_are_a_model_format_error(hf_model, tmp_path):
    path = tmp_path / "bad.gguf"
    original = _llama_cpp_rope_factors
    for bad in (np.ones(3, np.float32), -np.ones(16, np.float32)):
        globals()["_llama_cpp_rope_factors"] = lambda c, bad=bad: bad
        try:
            _write_gguf(hf_model, path)
        finally:
            globals()["_llama_cpp_rope_factors"] = original
        with pytest.raises(tmac.ModelFormatError, match="rope_f"):
            tmac.load_model(str(path), progress=False)
