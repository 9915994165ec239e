"""``tmac perplexity``: the windowed perplexity against one computed by hand from the model's logits."""
import json
import math
import subprocess
import sys

import numpy as np
import pytest

import tmac
from tmac.models.family.llama import LlamaConfig
from tmac.models.run.perplexity import perplexity
from tmac.models.files.synthetic import write_random_gguf

TEXT = "hello world, hello there. " * 12 + "the hell of help is held in hello."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl") / "tiny.gguf"
    write_random_gguf(str(path), LlamaConfig(vocab_size=300, dim=64, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=128,
                                             context_length=64), "Q4_0")
    return path


def _by_hand(model, text, context):
    """Each scored token's probability from its own run over the tokens before it in its window (a fresh sequence
    each time: no cache, no batching), softmax in float64."""
    ids = model.tokenizer.encode(text)
    nll = []
    for w in range(len(ids) // context):
        window = ids[w * context:(w + 1) * context]
        for j in range(context // 2, context - 1):
            logits = tmac.Session(model).logits(window[:j + 1])[-1].double().numpy()
            p = np.exp(logits - logits.max())
            nll.append(-math.log(p[window[j + 1]] / p.sum()))
    return math.exp(sum(nll) / len(nll)), len(nll)


def test_perplexity_equals_the_one_computed_by_hand(tiny):
    model = tmac.load_model(str(tiny), context=32, progress=False)
    expected, scored = _by_hand(model, TEXT, 32)
    got = perplexity(model, TEXT, 32)
    assert got.tokens_scored == scored and got.windows == len(model.tokenizer.encode(TEXT)) // 32
    assert got.perplexity == pytest.approx(expected, rel=1e-4)
    assert 0 < got.uncertainty < got.perplexity


@pytest.mark.slow
def test_perplexity_cli_json_and_errors(tiny, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    model = tmac.load_model(str(tiny), context=32, progress=False)
    expected = perplexity(model, TEXT, 32, max_windows=1).perplexity
    run = [sys.executable, "-m", "tmac", "perplexity", str(tiny), "--text", str(text), "--context", "32"]
    r = subprocess.run(run + ["--windows", "1", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["perplexity"] == pytest.approx(expected, rel=1e-5) and out["windows"] == 1
    for extra, needle in ((["--context", "4096"], "fewer than one window"), (["--windows", "0"], "--windows"),
                          (["--context", "15"], "even number")):
        r = subprocess.run(run[:-2] + extra, capture_output=True, text=True)
        assert r.returncode == 1 and needle in r.stderr, r.stderr
    r = subprocess.run(run[:4] + ["--text", str(tmp_path / "missing.txt")], capture_output=True, text=True)
    assert r.returncode == 1 and "missing.txt" in r.stderr


def test_a_long_text_is_tokenized_in_pieces_exactly_and_only_as_far_as_needed(monkeypatch):
    """Pieces with an overlap give the ids of the whole text tokenized at once (words across a cut included); with
    --windows only the text those windows need is tokenized."""
    import tmac.models.run.perplexity as module
    from conftest import smollm2_path

    tok = tmac.load_model(smollm2_path(), context=16, progress=False).tokenizer
    text = open(module.DEFAULT_TEXT).read()
    whole = tok.encode(text)
    for size in (97, 1000, 4096):
        monkeypatch.setattr(module, "PIECE_CHARS", size)
        monkeypatch.setattr(module, "OVERLAP", 256)
        assert list(module.tokenize(tok, text)) == whole
    monkeypatch.setattr(module, "PIECE_CHARS", 1000)
    calls = []
    original = tok.backend.encode
    monkeypatch.setattr(tok, "backend", type("Counting", (), {"encode": lambda self, t, **kw: calls.append(len(t))
                                                               or original(t, **kw)})())
    few = module.tokenize(tok, text * 100, need=600)
    assert list(few[:600]) == whole[:600] and sum(calls) < 10_000  # not the 1.5 M characters
