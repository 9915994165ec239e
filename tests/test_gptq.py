"""GPTQ import: tensors packed here, independently (Python ints, AutoGPTQ's bit order), from known integers."""
import json

import numpy as np
import pytest
import torch

import tmac
from tmac.models.files.gptq import import_gptq


def _pack(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """AutoGPTQ layout: along ``axis``, every 32 codes form one little-endian bit stream of ``bits`` int32 words."""
    v = np.moveaxis(values, axis, -1)
    words = np.zeros((*v.shape[:-1], v.shape[-1] * bits // 32), dtype=np.int64)
    for idx in np.ndindex(*v.shape[:-1]):
        for run in range(v.shape[-1] // 32):
            acc = 0
            for k in range(32):
                acc |= int(v[idx + (run * 32 + k,)]) << (bits * k)
            for j in range(bits):
                word = (acc >> (32 * j)) & 0xFFFFFFFF
                words[idx + (run * bits + j,)] = word - (1 << 32) if word >= 1 << 31 else word
    return np.ascontiguousarray(np.moveaxis(words.astype(np.int32), -1, axis))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("version", ["gptq", "gptq_v2"])
def test_gptq_dequantizes_exactly(rng, bits, version):
    k, m, group = 256, 64, 64
    codes = rng.integers(0, 1 << bits, (k, m))
    zero = rng.integers(1 if version == "gptq" else 0, 1 << bits, (k // group, m))  # the true zero point
    stored = zero - 1 if version == "gptq" else zero  # v1 stores zero − 1
    scales = (rng.random((k // group, m)) * 0.1 + 0.01).astype(np.float16)
    qw = import_gptq(_pack(codes, bits, 0), _pack(stored, bits, 1), scales, np.arange(k) // group, bits, group,
                     version)
    assert qw.shape == (m, k) and qw.format.scale_dtype == "float16"  # stored as the checkpoint's float16
    expected = (np.repeat(scales.astype(np.float64), group, axis=0) * (codes - np.repeat(zero, group, axis=0))).T
    np.testing.assert_array_equal(qw.dequantize(), expected.astype(np.float32))


def test_gptq_refuses_act_order_and_bad_shapes(rng):
    codes = _pack(rng.integers(0, 16, (128, 32)), 4, 0)
    zeros = _pack(rng.integers(0, 16, (2, 32)), 4, 1)
    scales = np.ones((2, 32), np.float16)
    with pytest.raises(ValueError, match="desc_act"):
        import_gptq(codes, zeros, scales, rng.permutation(np.arange(128) // 64), 4, 64)
    with pytest.raises(ValueError, match="scales"):
        import_gptq(codes, zeros, scales[:1], None, 4, 64)
    with pytest.raises(ValueError, match="bits"):
        import_gptq(codes, zeros, scales, None, 8, 64)


def test_gptq_checkpoint_loads_through_load_model(tmp_path, rng):
    from safetensors.torch import save_file

    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 128, "intermediate_size": 256,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
           "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "quantization_config": {"quant_method": "gptq", "bits": 2, "group_size": 32, "desc_act": False,
                                   "sym": False}}
    tensors, expected = {}, {}
    shapes = {"self_attn.q_proj": (128, 128), "self_attn.k_proj": (64, 128), "self_attn.v_proj": (64, 128),
              "self_attn.o_proj": (128, 128), "mlp.gate_proj": (256, 128), "mlp.up_proj": (256, 128),
              "mlp.down_proj": (128, 256)}
    for name, (m, k) in shapes.items():
        codes, zero = rng.integers(0, 4, (k, m)), rng.integers(1, 4, (k // 32, m))
        scales = (rng.random((k // 32, m)) * 0.05 + 0.01).astype(np.float16)
        p = f"model.layers.0.{name}"
        tensors |= {f"{p}.qweight": torch.from_numpy(_pack(codes, 2, 0)),
                    f"{p}.qzeros": torch.from_numpy(_pack(zero - 1, 2, 1)),
                    f"{p}.scales": torch.from_numpy(scales), f"{p}.g_idx": torch.arange(k, dtype=torch.int32) // 32}
        expected[name] = (np.repeat(scales.astype(np.float64), 32, 0) * (codes - np.repeat(zero, 32, 0))).T
    for name, shape in {"model.embed_tokens.weight": (64, 128), "lm_head.weight": (64, 128),
                        "model.norm.weight": (128,), "model.layers.0.input_layernorm.weight": (128,),
                        "model.layers.0.post_attention_layernorm.weight": (128,)}.items():
        tensors[name] = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = tmac.load_model(tmp_path)
    wqkv = model.layers[0].attention.wqkv.dequantized_weight().numpy()
    want = np.concatenate([expected["self_attn.q_proj"], expected["self_attn.k_proj"], expected["self_attn.v_proj"]])
    np.testing.assert_array_equal(wqkv, want.astype(np.float32))
    np.testing.assert_array_equal(model.layers[0].feed_forward.w2.dequantized_weight().numpy(),
                                  expected["mlp.down_proj"].astype(np.float32))
    assert tmac.Session(model).logits([1, 2, 3]).shape == (3, 64)
    cfg["quantization_config"]["desc_act"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(tmac.ModelFormatError, match="desc_act"):
        tmac.load_model(tmp_path)
