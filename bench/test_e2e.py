"""End to end: generation and prefill tok/s (and the weight GB/s they imply) at 1 and 2 threads, beside llama.cpp on
the very same GGUF file when the optional `peer` extra is installed:

- SmolLM2-135M-Instruct Q4_1 (imported exactly) and requantized W2 (with the default 8-bit head, and a W4 one);
- a synthetic Llama-1B-shape model: Q4_0 (exact) and W2 g128 with a W2 head, and Q4_0 again after a 1024-token
  prompt (long context: the KV cache read by attention grows with it); Q4_K, llama.cpp's usual 4-bit type (exact:
  4.625 bits a weight, its 6-bit multipliers as bytes, against the file's 4.5), Q4_K_M (Q4_K with a Q6_K head and
  some Q6_K attn_v/ffn_down, as llama.cpp mixes them; Q6_K exact at the file's 6.5625 bits) and Q5_K (exact, 5.625
  against 5.5); ternary TQ2_0 and TQ1_0 (exact, head too: both as triples, 1.67 bits a weight, where 64-entry
  lookups make them pay — AVX-512 VBMI —, else as 2-bit planes; against the files' 2.06 and 1.69);
  Q2_K made by llama.cpp's own quantizer with `--pure` semantics: exact (3.125 bits against 2.625), and tmac W2 g128
  of the same weights;
- the BitNet-3B projection shapes rounded to llama.cpp's 256-blocks (3328/8704, 26 layers), ternary TQ2_0;
  and at its real shape (3200/8640, 32 heads of 100) as a packed-ternary Hugging Face directory with a W4 head,
  tmac only (llama.cpp's ternary types need 256-multiples).

Synthetic files are written once (seeded) into the bench cache directory. Run:
`pytest -q bench/test_e2e.py --threads 1 -s` (or `tmac bench --e2e MODEL` for any model).
"""
import importlib.util
import os

import pytest

from tmac.apps.bench import e2e_bench, table

CACHE = os.path.join(os.path.dirname(__file__), "..", ".benchmarks")
LLAMA_FTYPE_MOSTLY_Q2_K = 10  # llama.cpp's enum llama_ftype


def _synthetic(shape: str, weight_type: str, embd_type: str = "Q8_0") -> str:
    from make_synthetic_gguf import SHAPES, weight_types

    from tmac.models.files.synthetic import write_random_gguf

    ternary = "-bitnet-scales" if weight_type.startswith("TQ") else ""  # files before that held N(0, σ) blocks
    path = os.path.join(CACHE, f"{shape}-{weight_type.lower()}{ternary}.gguf")
    if not os.path.exists(path):
        os.makedirs(CACHE, exist_ok=True)
        write_random_gguf(path + ".tmp", SHAPES[shape], weight_types(SHAPES[shape], weight_type, embd_type))
        os.replace(path + ".tmp", path)
    return path


def _bitnet_dir(shape: str) -> str:
    from make_synthetic_gguf import SHAPES

    from tmac.models.files.synthetic import write_random_bitnet_dir

    path = os.path.join(CACHE, f"{shape}-hf")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        write_random_bitnet_dir(path, SHAPES[shape])
    return path


def _llama_cpp_q2_k(shape: str) -> str:
    """Q2_K for every projection and the head (llama.cpp's `--pure`), quantized by llama.cpp from an F16 file."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("Q2_K needs llama.cpp's quantizer: install the optional peer extra")
    import llama_cpp

    path = os.path.join(CACHE, f"{shape}-q2_k-pure.gguf")
    if not os.path.exists(path):
        source = _synthetic(shape, "F16", "F16")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.pure, params.nthread = LLAMA_FTYPE_MOSTLY_Q2_K, True, 2
        if llama_cpp.llama_model_quantize(source.encode(), (path + ".tmp").encode(), params) != 0:
            raise RuntimeError("llama.cpp failed to quantize to Q2_K")
        os.replace(path + ".tmp", path)
    return path


CASES = {  # name → (file, tmac variants (bits, head bits); bits None = the file's own weights[, prompt tokens])
    "smollm2": (lambda: None, [(None, None), (2, None), (2, 4)]),
    "llama-1b-q4_0": (lambda: _synthetic("llama-1b", "Q4_0"), [(None, None), (2, 2)]),
    "llama-1b-q4_0-long": (lambda: _synthetic("llama-1b", "Q4_0"), [(None, None)], 1024),
    "llama-1b-q4_k": (lambda: _synthetic("llama-1b", "Q4_K"), [(None, None)]),
    "llama-1b-q4_k_m": (lambda: _synthetic("llama-1b", "Q4_K_M"), [(None, None)]),
    "llama-1b-q5_k": (lambda: _synthetic("llama-1b", "Q5_K"), [(None, None)]),
    "llama-1b-tq2_0": (lambda: _synthetic("llama-1b", "TQ2_0"), [(None, None)]),
    "llama-1b-tq1_0": (lambda: _synthetic("llama-1b", "TQ1_0"), [(None, None)]),
    "llama-1b-q2_k": (lambda: _llama_cpp_q2_k("llama-1b"), [(None, None), (2, 2)]),
    "bitnet-3b-tq2_0": (lambda: _synthetic("bitnet-3b-llama", "TQ2_0"), [(None, None)]),
    "bitnet-3b-real-shape": (lambda: _bitnet_dir("bitnet-3b"), [(None, 4)]),  # tmac only: 3200/8640, W4 head
}


@pytest.mark.parametrize("case", list(CASES))
def test_generation_speed(request, case):
    threads = [int(t) for t in request.config.getoption("threads").split(",")]
    notes: list[str] = []
    make, variants, *prompt = CASES[case]
    rows = e2e_bench(make(), variants, threads, notes, prompt_tokens=prompt[0] if prompt else 64, gen_tokens=64)
    print("\n" + table(rows, "tok/s", rows[0].candidate))
    for note in dict.fromkeys(notes):
        print("note:", note)
    assert rows and all(r.value > 0 for r in rows)
