"""Perplexity: tmac against llama.cpp on the same GGUF file and text, same windows (1 % is the bar for exact
imports), and what requantizing costs in quality. Needs the ``peer`` extra (llama-cpp-python).

Run: ``pytest bench/test_perplexity.py -s``.
"""
import json
import os
import subprocess
import sys

import pytest

import tmac
from tmac.models.run.perplexity import DEFAULT_TEXT, perplexity

pytest.importorskip("llama_cpp", reason="llama.cpp comparisons need the peer extra (see docs/llama-cpp.md)")

HERE = os.path.dirname(__file__)
CONTEXT = 512


def _models():
    from tmac.models.files.load import default_model_path

    return {"SmolLM2-135M-Instruct Q4_1": default_model_path()}


def llama_cpp_perplexity(path: str, text: str, context: int) -> dict:
    r = subprocess.run([sys.executable, os.path.join(HERE, "llama_cpp_perplexity.py"), path, text, str(context)],
                       capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(_models()))
def test_exact_import_matches_llama_cpp(name):
    path = _models()[name]
    peer = llama_cpp_perplexity(path, DEFAULT_TEXT, CONTEXT)
    model = tmac.load_model(path, context=CONTEXT, progress=False)
    assert model.tokenizer.encode(open(DEFAULT_TEXT).read()) == peer["ids"]  # the same tokens are scored
    ours = perplexity(model, open(DEFAULT_TEXT).read(), CONTEXT)
    print(f"\n{name}: tmac {ours.perplexity:.4f}, llama.cpp {peer['perplexity']:.4f} "
          f"({ours.perplexity / peer['perplexity'] - 1:+.2%}), {ours.tokens_scored} tokens scored")
    assert ours.tokens_scored == peer["tokens_scored"]
    assert abs(ours.perplexity / peer["perplexity"] - 1) < 0.01


@pytest.mark.parametrize("bits", [None, 4, 3, 2])
def test_requantized_quality(bits):
    """The quality column of the speed tables: the default model as imported and requantized to W4/W3/W2."""
    model = tmac.load_model(_models()["SmolLM2-135M-Instruct Q4_1"], bits=bits, context=CONTEXT, progress=False)
    ours = perplexity(model, open(DEFAULT_TEXT).read(), CONTEXT)
    print(f"\nSmolLM2-135M-Instruct, {'own Q4_1' if bits is None else f'W{bits}'}: perplexity "
          f"{ours.perplexity:.3f} ± {ours.uncertainty:.3f}")
    assert ours.perplexity > 1
