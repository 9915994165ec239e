"""The dot-product GEMM (many activation rows, 4-bit codes: codegen/dot.py) against its numpy oracle
(``tmac.base.reference.dot_matmul``), on every ISA this machine runs that has one."""
import dataclasses

import numpy as np
import pytest
import torch

from conftest import rel_l2, runnable_isas
from tmac import QuantizedWeight, WeightFormat, quantize_weight
from tmac.base import reference as ref
from tmac.execution.lut_ops import (DOT_ROWS_ENV, LutWeight, dot_buffers, dot_padded_rows, prompt_rows,
                                    takes_dot_products)
from tmac.execution.packing import pack
from tmac.kernels import ISAS
from tmac.quant.choose import spec_for
from tmac.quant.held import held_weight

DOT_ISAS = [i for i in runnable_isas() if ISAS[i].dot_rows > 0]
pytestmark = pytest.mark.skipif(not DOT_ISAS, reason="no ISA of this CPU has dot-product kernels")


def _weight(rng, kind: str, m: int, k: int) -> QuantizedWeight:
    if kind.startswith("IQ"):  # the i-quants' codebook codes, from llama.cpp-layout blocks
        from tmac.models.files.synthetic import k_quant_blocks
        from tmac.quant.quantize import import_gguf

        return import_gguf(k_quant_blocks(rng, m, k, kind), kind, (m, k))
    if kind.startswith("Q"):
        import gguf

        from tmac.models.files.synthetic import k_quant_blocks
        from tmac.quant.quantize import import_gguf

        if kind.endswith("_K"):
            blocks = k_quant_blocks(rng, m, k, kind)
        else:  # gguf-py's quantizer, as llama.cpp's files hold them
            w = (rng.standard_normal((m, k)) * 0.02).astype(np.float32)
            blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
        return import_gguf(blocks, kind, (m, k))
    w = rng.standard_normal((m, k)).astype(np.float32)
    bits, group = kind.split("-")[0].split("g")  # "w<bits>g<group>[-sym]"
    return quantize_weight(w, bits=int(bits[1:]), group_size="row" if group == "row" else int(group),
                           symmetric=kind.endswith("-sym"))


def _kernels(qw, isa):
    lw = LutWeight(pack(qw, spec_for(qw, ISAS[isa])))
    assert lw.spec.dot_products and "dot_gemm" in lw.spec.functions
    return lw


@pytest.mark.parametrize("isa", DOT_ISAS)
def test_activations_quantize_as_the_reference(rng, isa):
    """``quantize_rows``: int8 activations, their scales and each weight group's sums of them bit for bit the
    reference's (a block of zeros, a tie rounded to even), for groups of 16, 32, 128 and a whole row."""
    k, n = 256, 5
    x = rng.standard_normal((n, k)).astype(np.float32) * np.float32(3.0)
    x[1, 32:64] = 0
    x[2, 64:96] = 0
    x[2, 70] = -5.5
    x[4, 96:128] = np.float32(127.0)
    x[4, 100] = np.float32(-63.5)  # 127/127 = 1: −63.5 is a tie, rounded to even
    want_q, want_d = ref.quantize_activations(x)
    for group in (16, 32, 128, "row"):
        lw = _kernels(quantize_weight(rng.standard_normal((64, k)).astype(np.float32), bits=4, group_size=group), isa)
        xq, xd, xs = dot_buffers(lw.spec, dot_padded_rows(lw.spec, n))
        lw.kernels.quantize_rows(torch.from_numpy(x), xq, xd, xs)
        np.testing.assert_array_equal(xq.numpy()[:n], want_q)
        np.testing.assert_array_equal(xd.numpy()[:n], want_d)
        assert xq.numpy()[4, 100] == -64 and (xq.numpy()[1, 32:64] == 0).all() and xd.numpy()[1, 1] == 0
        np.testing.assert_array_equal(xs.numpy()[:n], ref.quantized_sums(want_q, want_d, lw.spec.group_size))


@pytest.mark.parametrize("isa", DOT_ISAS)
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quant_activations_take_one_scale_a_super_group(rng, isa, kind):
    """A K-quant's dot products quantize activations per super group of 256 (llama.cpp's Q8_K), so that its
    multipliers sum in integers: XQ, XD and the groups' sums bit for bit the reference's at that block (a super
    group of zeros; a tie rounded to even)."""
    k, n = 512, 5
    x = rng.standard_normal((n, k)).astype(np.float32)
    x[1, 256:] = 0
    x[3, 10] = np.float32(127.0)
    x[3, 20] = np.float32(-63.5)
    lw = _kernels(_weight(rng, kind, 64, k), isa)
    assert lw.spec.super_groups and lw.spec.activation_block == 256
    want_q, want_d = ref.quantize_activations(x, 256)
    xq, xd, xs = dot_buffers(lw.spec, dot_padded_rows(lw.spec, n))
    assert tuple(xd.shape) == (xq.shape[0], k // 256)
    lw.kernels.quantize_rows(torch.from_numpy(x), xq, xd, xs)
    np.testing.assert_array_equal(xq.numpy()[:n], want_q)
    np.testing.assert_array_equal(xd.numpy()[:n], want_d)
    assert xq.numpy()[3, 20] == -64 and xd.numpy()[1, 1] == 0 and (xq.numpy()[1, 256:] == 0).all()
    np.testing.assert_array_equal(xs.numpy()[:n], ref.quantized_sums(want_q, want_d, lw.spec.group_size, 256))


@pytest.mark.parametrize("isa", DOT_ISAS)
@pytest.mark.parametrize("kind", ["w4g32", "w4g128-sym", "w4grow", "w4g16", "w3g64", "w5g32", "w6g16-sym", "Q4_0",
                                  "Q4_1", "Q4_K", "Q3_K", "Q5_K", "Q6_K", "IQ1_S"])
def test_dot_gemm_matches_its_oracle(rng, isa, kind):
    """``dot_gemm`` of 3- to 6-bit codes (bit-plane chunks of 4, 2 and 1 planes), and IQ1_S's 2-bit K-quant form,
    and every parameter kind (float32 and float16 scales, zeros or none, groups of 16 to a whole row, llama.cpp's
    Q4_0/Q4_1 blocks and the K-quants' byte multipliers of d and dmin, Q3_K's and Q6_K's signed) against the
    reference, with a partial last row block and a partial last tile of activation rows; codes in quads keep table
    lookups at any row count (and IQ1_S on arm64, measured on x86 only), but codebook codes (IQ1_S where the kernels
    expand its grid)."""
    m, k = 200, 512
    qw = _weight(rng, kind, m, k)
    lw = LutWeight(pack(qw, spec_for(qw, ISAS[isa])))
    # the one layout of these codes without dot products: quads (64-entry lookups, AVX-512 VBMI: 3 and 5 bits)
    assert lw.spec.dot_products != (lw.spec.quads and not lw.spec.codebook or kind == "IQ1_S" and
                                    ISAS[isa].arch != "x86_64")
    qw = held_weight(qw, lw.spec)[0]  # (IQ1_S's grid: as codebook codes, the same weights)
    for n in (ISAS[isa].dot_rows, ISAS[isa].dot_rows + 5):
        assert takes_dot_products(lw.spec, n) == lw.spec.dot_products
        x = rng.standard_normal((n, k)).astype(np.float32)
        y = lw.matmul(torch.from_numpy(x)).numpy()
        want = ref.dot_matmul(x, qw, lw.spec.activation_block) if lw.spec.dot_products else ref.lut_matmul(x, qw)
        assert rel_l2(y, want) <= 1e-5
        # and against the exact product: llama.cpp's rounding of activations (8 bits a block of 32, or of a
        # K-quant's super group of 256 as its Q8_K)
        exact = x.astype(np.float64) @ qw.dequantize().astype(np.float64).T
        assert rel_l2(y, exact) <= 0.03


@pytest.mark.parametrize("isa", DOT_ISAS)
@pytest.mark.parametrize("kind, k, k_chunk", [("w4g32", 512, 192), ("w4grow", 512, 128), ("w6g16-sym", 512, 192),
                                              ("Q4_K", 768, 512), ("Q6_K", 768, 256)])
def test_dot_gemm_reads_weights_stored_in_k_chunks(rng, isa, kind, k, k_chunk):
    """Weights packed in K chunks (the LUT kernels' order on 16-byte vectors: a chunk's rows of every block, then
    the next chunk's; a shorter last chunk) give the dot products the oracle's result: the steps, the groups' scales
    and a K-quant's multipliers and super scales are each found in their chunk."""
    m, n = 80, 7
    qw = _weight(rng, kind, m, k)
    lw = LutWeight(pack(qw, spec_for(qw, ISAS[isa], k_chunk=k_chunk)))
    assert lw.spec.k_chunk == k_chunk < lw.spec.k_padded and lw.spec.dot_products
    x = rng.standard_normal((n, k)).astype(np.float32)
    with prompt_rows():
        y = lw.matmul(torch.from_numpy(x)).numpy()
    assert rel_l2(y, ref.dot_matmul(x, qw, lw.spec.activation_block)) <= 1e-5


@pytest.mark.parametrize("isa", DOT_ISAS)
@pytest.mark.parametrize("kind", ["IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_S", "IQ1_M"])
def test_codebook_dot_gemm_matches_its_oracle(rng, isa, kind):
    """The i-quants' codebook codes (16 integer levels up to ±127; bit-plane bytes, or quads on AVX-512 VBMI) take
    dot products on their levels where the ISA multiplies them without saturating (VNNI's ``vpdpbusd`` on the
    levels + 128; without VNNI ``vpmaddubsw`` on |level| and the activation with the level's sign; arm64's
    ``sdot``), and a prompt's product is then the oracle's; elsewhere (arm64 without dotprod) table lookups."""
    m, k, n = 200, 512, 37
    qw = _weight(rng, kind, m, k)
    lw = LutWeight(pack(qw, spec_for(qw, ISAS[isa])))
    assert lw.spec.codebook and lw.spec.dot_products == ISAS[isa].dot_codebooks
    assert lw.spec.dot_products or ISAS[isa].arch != "x86_64"  # (every x86 ISA with dot products multiplies levels)
    x = rng.standard_normal((n, k)).astype(np.float32)
    with prompt_rows():
        y = lw.matmul(torch.from_numpy(x)).numpy()
    want = ref.dot_matmul(x, qw, lw.spec.activation_block) if lw.spec.dot_products else ref.lut_matmul(x, qw)
    assert rel_l2(y, want) <= 1e-5
    assert rel_l2(y, x.astype(np.float64) @ qw.dequantize().astype(np.float64).T) <= 0.03


@pytest.mark.parametrize("isa", DOT_ISAS)
def test_integer_part_is_bit_exact(rng, isa):
    """Activations already int8 with a 127 in every block (scale 1), weight scale 1 and zero −offset: y is the
    integer product of codes and activations, exactly."""
    m, k, n = 96, 256, 36
    fmt = WeightFormat("w4exact", 4, 32, has_zeros=True)
    codes = rng.integers(0, 16, (m, k)).astype(np.uint8)
    qw = QuantizedWeight(codes, np.ones((m, k // 32), np.float32), np.full((m, k // 32), -8.0, np.float32), fmt)
    x = rng.integers(-127, 128, (n, k)).astype(np.float32)
    x[:, ::32] = 127
    y = _kernels(qw, isa).matmul(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(y, (x.astype(np.int64) @ codes.astype(np.int64).T).astype(np.float32))


@pytest.mark.parametrize("isa", DOT_ISAS)
def test_rows_below_the_threshold_look_up_tables(rng, isa, monkeypatch):
    """Below the ISA's ``dot_rows`` (and with ``TMAC_DOT_ROWS=0`` at any count) a GEMM is the LUT kernels' (the
    table oracle's result); from it, the dot products' (theirs); a bad ``TMAC_DOT_ROWS`` is refused by name."""
    m, k = 64, 256
    qw = _weight(rng, "w4g32", m, k)
    lw = _kernels(qw, isa)
    rows = ISAS[isa].dot_rows
    below, at = (rng.standard_normal((n, k)).astype(np.float32) for n in (rows - 1, rows))
    assert rel_l2(lw.matmul(torch.from_numpy(below)).numpy(), ref.lut_matmul(below, qw)) <= 1e-5
    assert rel_l2(lw.matmul(torch.from_numpy(at)).numpy(), ref.dot_matmul(at, qw)) <= 1e-5
    monkeypatch.setenv(DOT_ROWS_ENV, "0")
    assert rel_l2(lw.matmul(torch.from_numpy(at)).numpy(), ref.lut_matmul(at, qw)) <= 1e-5
    monkeypatch.setenv(DOT_ROWS_ENV, "8")
    assert rel_l2(lw.matmul(torch.from_numpy(below[:8])).numpy(), ref.dot_matmul(below[:8], qw)) <= 1e-5
    monkeypatch.setenv(DOT_ROWS_ENV, "many")
    with pytest.raises(ValueError, match="TMAC_DOT_ROWS"):
        lw.matmul(torch.from_numpy(at))


@pytest.mark.parametrize("isa", DOT_ISAS)
def test_a_whole_row_group_is_a_loop_not_code_that_grows_with_k(isa):
    """A weight group of a whole row is summed by a loop over its units of 32: the kernel's instructions are the
    same for K = 512 and 4096 (emitted unit by unit, a K of 2304 took minutes to compile)."""
    from tmac.codegen import dot

    intrinsics = []
    for k in (512, 4096):
        qw = quantize_weight(np.random.default_rng(0).standard_normal((64, k)).astype(np.float32), bits=4,
                             group_size="row")
        spec = spec_for(qw, ISAS[isa])
        assert spec.dot_products and spec.group_size == k
        intrinsics.append(dot.dot_gemm_func(spec, ISAS[isa]).script().count("call_llvm_pure_intrin"))
    assert intrinsics[0] == intrinsics[1] > 0


def test_which_specs_have_dot_products():
    """Bit-plane codes of 3 to 6 bits, in one K chunk or several, on an ISA with dot products (x86, and arm64 with
    ``sdot``); not 2-bit codes (two planes' lookups cost no more) but IQ1_S's on x86 (super groups of 32-weight
    groups, not in quads; its grid's codebook codes on AVX-512 VBMI), nor 8-bit codes, or ISAs without (arm64 without dotprod and the generic fallback keep
    table lookups)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 512)).astype(np.float32)
    qw = quantize_weight(w, bits=4, group_size=32)
    spec = spec_for(qw, ISAS["avx2"])
    assert spec.dot_products and spec.functions[-2:] == ("quantize_rows", "dot_gemm")
    assert dataclasses.replace(spec, k_chunk=256).dot_products
    assert all(spec_for(quantize_weight(w, bits=b, group_size=32), ISAS["avx2"]).dot_products for b in (3, 5, 6))
    assert not any(spec_for(quantize_weight(w, bits=b, group_size=32), ISAS[i]).dot_products
                   for b in (2, 8) for i in ("avx2", "neon_dotprod"))
    from tmac.models.files.synthetic import k_quant_blocks
    from tmac.quant.quantize import import_gguf

    iq1_s, q2_k = (import_gguf(k_quant_blocks(rng, 64, 512, t), t, (64, 512)) for t in ("IQ1_S", "Q2_K"))
    assert spec_for(iq1_s, ISAS["avx2"]).dot_products and not spec_for(q2_k, ISAS["avx2"]).dot_products
    vbmi = spec_for(iq1_s, ISAS["avx512_vbmi"])  # its grid indices, expanded to codebook codes: multiplied
    assert not spec_for(iq1_s, ISAS["neon_dotprod"]).dot_products and vbmi.grid == "IQ1_S" and vbmi.dot_products
    assert not spec_for(iq1_s, ISAS["avx512_vbmi"], grid="").dot_products  # (its 2-bit form: quads)
    assert spec_for(qw, ISAS["neon_dotprod"]).dot_products
    for other in ("neon", "generic_x86_64"):
        assert not spec_for(qw, ISAS[other]).dot_products


@pytest.mark.parametrize("ftype", ["Q4_0", "Q4_K_S", "Q4_K_M"])
def test_a_prefill_of_dot_products_is_as_close_to_the_exact_model_as_llama_cpp(ftype, monkeypatch):
    """The stored llama.cpp files (tests/test_mixes.py) prefilled with dot products (``TMAC_DOT_ROWS=8``: the
    12-token prompt takes them): the logits' distance to the float64 model of the same weights is at most llama.cpp's
    own (stored) distance, +10 % for the float order of another ISA — int8 activations a block of 32 and their
    rounded sums in the offset and zero terms, as llama.cpp's prefill rounds them."""
    import json
    import os

    import tmac
    from llama_fp64 import llama_logits
    from tmac.nn.linear import Linear

    data = os.path.join(os.path.dirname(__file__), "data")
    reference = json.load(open(os.path.join(data, "mixes.json")))
    path, prompt = os.path.join(data, "mixes", f"{ftype}.gguf"), reference["prompt"]
    monkeypatch.setenv(DOT_ROWS_ENV, "8")
    model = tmac.load_model(path, kv_dtype="float32", isa=DOT_ISAS[0], progress=False)
    assert any(takes_dot_products(m.spec, len(prompt)) for m in model.modules() if isinstance(m, Linear))
    got = tmac.Session(model).logits(prompt).numpy().astype(np.float64)
    exact = llama_logits(path, prompt)
    theirs = rel_l2(np.array(reference["files"][ftype]["logits"], np.float64), exact)
    assert rel_l2(got, exact) <= 1.1 * theirs
    assert (got.argmax(1) == exact.argmax(1)).mean() >= 0.9
