"""A Llama-2-7B MLP block (gate/up 4096→11008, down 11008→4096, SwiGLU) as a model runs it: decode (1 token)
and a short prefill (16 tokens), fp32 / bf16 / torch int4 weight-only / tmac W4 and W2, 1 and 2 threads.

Weights stream from DRAM as in a real model: candidates cycle through copies worth ≥ 1 GiB.
Run: `make bench` or `pytest bench/test_mlp.py --threads 1`.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tmac
from baselines import COLD_BYTES, int4_linear, int4pack, random_weights
from conftest import BYTES, record

HIDDEN, FFN = 4096, 11008
CANDIDATES = ["torch fp32", "torch bf16", "torch int4wo", "tmac W4", "tmac W2"]


class MLP(nn.Module):
    def __init__(self, gate, up, down):
        super().__init__()
        self.gate, self.up, self.down = gate, up, down

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Int4Linear(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.packed = int4pack(w)

    def forward(self, x):
        return int4_linear(x.to(torch.bfloat16), self.packed)


def _make(cand, seed):
    ws = [random_weights(FFN, HIDDEN, seed), random_weights(FFN, HIDDEN, seed + 1), random_weights(HIDDEN, FFN, seed + 2)]
    if cand.startswith("tmac"):
        layers = [tmac.Linear.from_float(w / 64, bits=int(cand[-1]), group_size=128) for w in ws]
    elif cand == "torch int4wo":
        layers = [Int4Linear(w / 64) for w in ws]
    else:
        dtype = torch.bfloat16 if cand == "torch bf16" else torch.float32
        layers = []
        for w in ws:
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=dtype)
            lin.weight.data.copy_(w / 64)
            layers.append(lin)
    return MLP(*layers)


def _nbytes(model):
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]
               if not isinstance(t, tuple)) + sum(
        sum(p.numel() * p.element_size() for p in m.packed) for m in model.modules() if isinstance(m, Int4Linear))


_CACHE = {}


@pytest.mark.parametrize("tokens", [1, 16])
@pytest.mark.parametrize("cand", CANDIDATES)
def test_mlp_block(benchmark, set_threads, tokens, cand):
    if cand not in _CACHE:
        _CACHE.clear()
        first = _make(cand, 0)
        copies = max(1, COLD_BYTES // _nbytes(first))
        _CACHE[cand] = [first] + [_make(cand, 3 * i) for i in range(1, copies)]
    models = _CACHE[cand]
    x = torch.randn(tokens, HIDDEN)
    if cand == "torch bf16":
        x = x.to(torch.bfloat16)
    state = {"i": 0}

    def step():
        m = models[state["i"] % len(models)]
        state["i"] += 1
        return m(x)

    with torch.inference_mode():
        step()
        benchmark.group = f"mlp 7B {tokens} tok {set_threads}t"
        benchmark.pedantic(step, rounds=5, iterations=len(models), warmup_rounds=1)
    shape = f"Llama-2-7B MLP block, {tokens} token(s)"
    BYTES[(shape, cand)] = _nbytes(models[0])
    record(benchmark, ("cold", set_threads, shape, cand))
