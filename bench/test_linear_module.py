"""``tmac.Linear`` against the kernel path under it, and a Hugging Face model quantized by ``tmac.quantize_model``.

1. Per call: ``LutWeight.matmul`` (the checked kernel path ``tmac bench`` times: table build, lookup, Python call,
   a fresh output)
   against the same weights as ``tmac.Linear`` modules under ``torch.inference_mode``, warm (one copy, in cache) and
   cold (copies cycled through 1 GiB in huge pages, as a model's weights stream from DRAM), the two taking turns
   call by call in one run. The difference is what the module adds.
2. ``LlamaForCausalLM.generate`` (greedy, fixed token count) in float32, with torch's int4 weight-only kernel in
   every projection, and after ``tmac.quantize_model`` at W4 and W2.

Run: ``pytest bench/test_linear_module.py --threads 1 -s``.
"""
import copy
import time

import pytest
import torch
from torch import nn

import tmac
from baselines import int4_linear, int4pack, random_weights
from conftest import BYTES, RESULTS
from tmac import quantize_weight
from tmac.base.timing import cold_medians, warm_medians
from tmac.execution.lut_ops import LutWeight
from tmac.base.memory import huge_page_copies

SHAPES = [(64, 64), (4096, 4096), (11008, 4096)]


def _pair(m, k, bits):
    """(kernel candidate, module candidate): (make n copies, call one copy, bytes per copy)."""
    w = random_weights(m, k)
    x = torch.randn(1, k)
    group = 64 if k % 128 else 128
    lw = LutWeight.from_quantized(quantize_weight(w.numpy(), bits=bits, group_size=group))
    lin = tmac.Linear.from_float(w, bits=bits, group_size=group)
    lw.matmul(x)
    lin(x)

    def modules(n):
        out = []
        for packed in huge_page_copies((lin.qweight, lin.scales, lin.zeros), n):
            c = copy.copy(lin)
            c._buffers = dict(lin._buffers, qweight=packed[0], scales=packed[1], zeros=packed[2])
            out.append(c)
        return out
    return ((lw.copies, lambda c: c.matmul(x), lw.nbytes),
            (modules, lambda c: c(x), lw.nbytes))


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_linear_module_overhead(set_threads, shape, bits):
    kernel, module = _pair(*shape, bits)
    with torch.inference_mode():
        # (each input made once, bound as the lambda's default)
        warm = warm_medians([lambda c=make(1)[0], f=call: f(c) for make, call, _ in (kernel, module)])  # noqa: B008
        cold = cold_medians([kernel, module])
    for regime, (k_sec, m_sec) in (("warm", warm), ("cold", cold)):
        key = (f"tmac.Linear {regime}", set_threads, f"{shape[0]}x{shape[1]}")
        RESULTS[(*key, f"W{bits} kernel path")] = k_sec
        RESULTS[(*key, f"W{bits} tmac.Linear")] = m_sec
        BYTES[(key[2], f"W{bits} kernel path")] = BYTES[(key[2], f"W{bits} tmac.Linear")] = kernel[2]
        print(f"\n{key[0]} {key[2]} W{bits}: kernel path {k_sec * 1e6:.1f} µs, tmac.Linear {m_sec * 1e6:.1f} µs, "
              f"module adds {(m_sec - k_sec) * 1e6:+.1f} µs")
    assert min(warm + cold) > 0


# ---- a Hugging Face model: float, torch int4 weight-only, tmac -------------------------------------------------

class Int4WeightOnly(nn.Module):
    """``nn.Linear`` through torch's CPU int4 weight-only kernel (bfloat16 activations, groups of 128)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.packed = int4pack(linear.weight.detach().float(), 128)
        self.bias = linear.bias

    def forward(self, x):
        y = int4_linear(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), self.packed, 128).to(x.dtype)
        y = y.reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def _int4_model(model):
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear) and name != "lm_head":
            setattr(model, name, Int4WeightOnly(child))
        else:
            _int4_model(child)
    return model


def test_hf_generate(set_threads):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512)
    base = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 32000, (1, 32))
    variants = {"float32": base, "torch int4wo": _int4_model(copy.deepcopy(base)),
                "tmac W4": tmac.quantize_model(copy.deepcopy(base), bits=4, progress=False),
                "tmac W2": tmac.quantize_model(copy.deepcopy(base), bits=2, progress=False)}
    new = 32

    def generate(model):
        model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    with torch.inference_mode():
        for model in variants.values():  # compile and warm up
            model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
        seconds = {name: [] for name in variants}
        for _ in range(3):  # interleaved
            for name, model in variants.items():
                t0 = time.perf_counter()
                generate(model)
                seconds[name].append(time.perf_counter() - t0)
    key = ("HF generate, 32+32 tokens", set_threads, "LlamaForCausalLM 4x2048")
    for name, s in seconds.items():
        RESULTS[(*key, name)] = sorted(s)[1]
        print(f"\n{name}: {new / sorted(s)[1]:.1f} tok/s")
    assert all(min(s) > 0 for s in seconds.values())
