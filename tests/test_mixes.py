"""The files people download: llama.cpp's own quantizer wrote tests/data/mixes/ (a seeded tiny Llama in every
ftype, the mixes picking a type per tensor: Q6_K token tables and heads, attn_v/ffn_down a step up), and its
logits on a fixed prompt are stored beside them (tests/data/make_llama_cpp_mixes.py). Each loads exactly, and
tmac's logits match llama.cpp's."""
import collections
import json
import os

import gguf
import numpy as np
import pytest

import tmac

from conftest import runnable_isas
from llama_fp64 import llama_logits

DATA = os.path.join(os.path.dirname(__file__), "data")
REFERENCE = json.load(open(os.path.join(DATA, "mixes.json")))


def _relative(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("ftype", REFERENCE["files"])
def test_llama_cpp_ftype_matches_llama_cpp_logits(ftype):
    path = os.path.join(DATA, "mixes", f"{ftype}.gguf")
    ref = REFERENCE["files"][ftype]
    types = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2)
    model = tmac.load_model(path, kv_dtype="float32", progress=False)
    linears = [m for m in model.modules() if isinstance(m, tmac.Linear)]
    assert linears and not any(type(m).__name__ == "FloatLinear" for m in model.modules())  # every matrix quantized
    got = tmac.Session(model).logits(REFERENCE["prompt"]).numpy().astype(np.float64)
    want = np.array(ref["logits"], np.float64)
    exact = llama_logits(path, REFERENCE["prompt"])  # the same weights in float64, activations unrounded
    ours, theirs = _relative(got, exact), _relative(want, exact)
    print(f"{ftype} ({'tied' if ref['tied'] else 'untied'} head; {dict(types)}): rel L2 to float64 logits: "
          f"tmac {ours:.4f}, llama.cpp {theirs:.4f}; tmac to llama.cpp {_relative(got, want):.4f}")
    # Both engines round activations to 8 bits; only the L2 of that noise is a stable figure (the worst single
    # logit moves by half when torch's AVX-512 kernels replace its AVX2 ones and flip a few table roundings).
    # llama.cpp rounds each activation with one scale per 32-256 values; tmac rounds table entries, sums of 4
    # activations, with one scale per lut group of up to 128 (ternary, K-quant super rows): a coarser step, by the
    # ratio of the entries' range to the activations' (docs/decisions.md, "Activation rounding").
    assert ours <= 2.5 * theirs and _relative(got, want) <= 0.04
    # greedy choices are the exact model's wherever its first two are further apart than the noise can reach
    noise = float(np.sqrt(((got - exact) ** 2).mean()))
    top2 = np.sort(exact, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 6 * noise
    assert clear.sum() >= len(exact) // 2 and (got.argmax(1) == exact.argmax(1))[clear].all()


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("ftype", ["TQ2_0", "Q4_K_M", "IQ4_XS"])
def test_every_isa_this_cpu_runs_meets_the_same_bounds(ftype, isa):
    """ISAs that compute a prompt the same way — the same int8 table entries, or the same int8 activations'
    products — add the same integers: their logits are the best ISA's up to the float order of the epilogues, so the
    bounds above hold on every CPU class whose ISA this CPU runs. An ISA that takes the other way (an i-quant's
    prompt multiplies its levels only with VNNI) and the generic fallback meet the bound against the exact model
    themselves."""
    path = os.path.join(DATA, "mixes", f"{ftype}.gguf")
    model = tmac.load_model(path, kv_dtype="float32", isa=isa, progress=False)
    assert {m.spec.isa for m in model.modules() if isinstance(m, tmac.Linear)} == {isa}
    got = tmac.Session(model).logits(REFERENCE["prompt"])
    best_model = tmac.load_model(path, kv_dtype="float32", progress=False)

    def ways(m):
        return [lin.spec.dot_products for lin in m.modules() if isinstance(lin, tmac.Linear)]

    if not isa.startswith("generic") and ways(model) == ways(best_model):
        best = tmac.Session(best_model).logits(REFERENCE["prompt"])
        assert float((got - best).abs().max()) <= 1e-5 * float(best.abs().max())
    exact = llama_logits(path, REFERENCE["prompt"])
    want = np.array(REFERENCE["files"][ftype]["logits"], np.float64)
    assert _relative(got.numpy().astype(np.float64), exact) <= 2.5 * _relative(want, exact)


@pytest.mark.parametrize("ftype", REFERENCE["files"])
def test_every_ftype_round_trips_through_tmac_convert(ftype, tmp_path):
    """A converted file runs what its GGUF runs: the same logits and greedy tokens, for the mixes too (a fused q|k|v
    whose parts have different types: Q4_K q and k beside a Q6_K v)."""
    from tmac.models.files.convert import convert

    path = os.path.join(DATA, "mixes", f"{ftype}.gguf")
    out = str(tmp_path / f"{ftype}.tmac")
    convert(path, out, progress=False)
    runs = []
    for source in (path, out):
        model = tmac.load_model(source, kv_dtype="float32", progress=False)
        session = tmac.Session(model)
        runs.append((session.logits(REFERENCE["prompt"]),
                     session.generate(REFERENCE["prompt"], max_tokens=12, temperature=0, ignore_eos=True)))
    (gguf_logits, gguf_ids), (tmac_logits, tmac_ids) = runs
    assert tmac_ids == gguf_ids
    assert float((tmac_logits - gguf_logits).abs().max()) <= 1e-5 * float(gguf_logits.abs().max())


def test_a_file_converted_for_another_cpu_runs_here_repacked_with_a_warning(tmp_path):
    """``tmac convert --isa``/``--arch`` packs for another CPU (a Pi's file made on a laptop): the file records that
    ISA, and this CPU still runs it exactly (repacked as it loads), saying so."""
    from tmac.kernels import best_isa
    from tmac.models.files.convert import convert

    path = os.path.join(DATA, "mixes", "Q4_K_M.gguf")
    other = "neon_dotprod" if best_isa().arch == "x86_64" else "avx2"
    out = str(tmp_path / "other.tmac")
    done = convert(path, out, isa=other, progress=False)
    assert done["isa"] == other and not done["kernels_compiled"]
    with pytest.warns(UserWarning, match=f"packed for {other}, not for this CPU's {best_isa().name}"):
        model = tmac.load_model(out, kv_dtype="float32")
    assert {m.packed_for for m in model.modules() if isinstance(m, tmac.Linear)} == {other}
    assert {m.spec.isa for m in model.modules() if isinstance(m, tmac.Linear)} == {best_isa().name}
    got = tmac.Session(model).logits(REFERENCE["prompt"])
    want = tmac.Session(tmac.load_model(path, kv_dtype="float32", progress=False)).logits(REFERENCE["prompt"])
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
