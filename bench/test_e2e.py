"""End to end: generation and prefill tok/s of SmolLM2 (exact Q4_1 import, and W2) and of a synthetic Llama-1B-shape
model (exact Q4_0 import; W2 with a W2 head), 1 and 2 threads, beside llama.cpp on the very same GGUF file when
the optional `peer` extra is installed. The 1B file is written once (seeded) into the bench cache directory.

Run: `pytest -q bench/test_e2e.py --threads 1` (or `tmac bench MODEL` for any model).
"""
import os

import pytest

from tmac.bench import e2e_bench, table

CACHE = os.path.join(os.path.dirname(__file__), "..", ".benchmarks")


def _llama_1b() -> str:
    from make_synthetic_gguf import SHAPES

    from tmac.models.synthetic import write_random_gguf

    path = os.path.join(CACHE, "llama-1b-q4_0.gguf")
    if not os.path.exists(path):
        os.makedirs(CACHE, exist_ok=True)
        write_random_gguf(path + ".tmp", SHAPES["llama-1b"], lambda name: "Q8_0" if name.startswith("token_embd")
                          else "Q4_0")
        os.replace(path + ".tmp", path)
    return path


@pytest.mark.parametrize("model", ["smollm2", "llama-1b"])
def test_generation_speed(request, model):
    threads = [int(t) for t in request.config.getoption("threads").split(",")]
    notes: list[str] = []
    source = None if model == "smollm2" else _llama_1b()
    rows = e2e_bench(source, [None, 2], threads, notes, prompt_tokens=64, gen_tokens=64,
                     head_bits=None if model == "smollm2" else 2)
    print("\n" + table(rows, "tok/s", rows[0].candidate))
    for note in dict.fromkeys(notes):
        print("note:", note)
    assert rows and all(r.value > 0 for r in rows)
