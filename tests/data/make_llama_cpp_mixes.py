"""Writes tests/data/mixes/: a seeded tiny Llama (F32) quantized by llama.cpp's own quantizer into every ftype people
download (its mixes: Q4_K_M and the like pick a type per tensor), and llama.cpp's logits on a fixed prompt for each
(mixes.json) — the reference tests/test_mixes.py compares tmac against. llama.cpp stays out of the test path.

Needs the optional peer (llama-cpp-python, built for this CPU: see the README). Run once:
    .venv/bin/python tests/data/make_llama_cpp_mixes.py [FTYPE ...]
(FTYPEs named: only those files are written, their entries added to mixes.json beside the others.)

llama.cpp quantizes the i-quants under 4 bits (``IMATRIX_FTYPES``; their mixes use IQ2_S and lower) only with an
importance matrix, which its Python binding cannot pass: those files come from its ``llama-quantize`` program
(``bench/llama_cpp_tools.py --targets llama-quantize`` builds it; its path in ``LLAMA_QUANTIZE``) with an importance
matrix of ones in llama.cpp's legacy imatrix format, written here (the seeded model's activations are random: no
weight is more important than another).
"""
import ctypes
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from tmac.models.family.llama import LlamaConfig  # noqa: E402
from tmac.models.files.synthetic import write_random_gguf  # noqa: E402

# ftype → tied embeddings (the head is then the token table, and llama.cpp picks its type as the output's)
FTYPES = {"Q2_K": False, "Q3_K_S": False, "Q3_K_M": True, "Q3_K_L": False, "Q4_K_S": False, "Q4_K_M": True,
          "Q5_K_S": True, "Q5_K_M": False, "Q6_K": True, "Q8_0": False, "Q4_0": True, "Q5_1": False,
          "IQ4_NL": False, "IQ4_XS": True, "TQ1_0": True, "TQ2_0": False,
          "IQ3_XXS": False, "IQ3_S": True, "IQ3_M": False, "IQ2_XXS": True, "IQ2_XS": False, "IQ2_S": True,
          "IQ2_M": False, "IQ1_S": False, "IQ1_M": True}
IMATRIX_FTYPES = ("IQ3_XXS", "IQ3_S", "IQ3_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M")
CONFIG = dict(vocab_size=300, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, context_length=64)
PROMPT = [5, 77, 260, 261, 262, 13, 100, 200, 299, 42, 7, 150]


def main(only: list[str]):
    import llama_cpp

    unknown = set(only) - set(FTYPES)
    if unknown:
        raise SystemExit(f"not an ftype here: {', '.join(sorted(unknown))} (known: {', '.join(FTYPES)})")
    out = os.path.join(HERE, "mixes")
    os.makedirs(out, exist_ok=True)
    reference = {"prompt": PROMPT, "config": CONFIG, "files": {}}
    if only:
        with open(os.path.join(HERE, "mixes.json")) as f:
            reference = json.load(f)
    with tempfile.TemporaryDirectory() as tmp:
        for name, tied in FTYPES.items():
            if only and name not in only:
                continue
            source = os.path.join(tmp, f"f32-{tied}.gguf")
            if not os.path.exists(source):
                write_random_gguf(source, LlamaConfig(**CONFIG, tie_embeddings=tied), "F32", seed=7)
            target = os.path.join(out, f"{name}.gguf")
            if name in IMATRIX_FTYPES:
                imatrix = os.path.join(tmp, "ones.imatrix")
                write_unit_imatrix(source, imatrix)
                subprocess.run([os.environ.get("LLAMA_QUANTIZE", "llama-quantize"), "--imatrix", imatrix, source,
                                target, name, "1"], check=True, capture_output=True)
            else:
                params = llama_cpp.llama_model_quantize_default_params()
                params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")
                params.nthread = 1
                if llama_cpp.llama_model_quantize(source.encode(), target.encode(), ctypes.byref(params)) != 0:
                    raise SystemExit(f"llama.cpp could not quantize to {name}")
            llm = llama_cpp.Llama(target, n_ctx=64, n_threads=1, logits_all=True, verbose=False)
            llm.eval(PROMPT)
            logits = np.array(llm.scores[:len(PROMPT)], dtype=np.float32)
            reference["files"][name] = {"tied": tied, "logits": [[round(float(v), 5) for v in row] for row in logits],
                                        "bytes": os.path.getsize(target)}
            print(f"{name}: {os.path.getsize(target)} bytes", file=sys.stderr)
            del llm
    with open(os.path.join(HERE, "mixes.json"), "w") as f:
        json.dump(reference, f)


def write_unit_imatrix(model: str, path: str) -> None:
    """llama.cpp's legacy imatrix file for every matrix of ``model``: i32 entries, then per entry i32 name length,
    the name, i32 calls, i32 values and that many f32 (the mean squared activation of each input): all 1."""
    import gguf

    matrices = [(t.name, int(t.shape[0])) for t in gguf.GGUFReader(model).tensors
                if len(t.shape) == 2 and t.name != "token_embd.weight"]
    with open(path, "wb") as f:
        f.write(struct.pack("<i", len(matrices)))
        for name, k in matrices:
            f.write(struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", 1, k))
            f.write(np.ones(k, np.float32).tobytes())


if __name__ == "__main__":
    main(sys.argv[1:])
