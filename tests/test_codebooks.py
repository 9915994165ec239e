"""Codebook formats (llama.cpp's IQ4_NL and IQ4_XS: 4-bit codes indexing 16 non-uniform levels) at their own size:
imported exactly (against the ``gguf`` package's dequantization), looked up in one table per activation by every
ISA this CPU runs (against the numpy reference and fp64), held at the file's bytes, and a model of them against
an fp64 forward of the same file. The grid i-quants (IQ1_M to IQ3_S: grid indices and sign bits) import exactly as
4-bit codes of their at most 16 levels, through the same kernels, held at those codes' bytes (not 8 bits) — IQ2_XXS
and IQ3_XXS where the kernels expand grids (AVX-512 VBMI) at their own, as indices and sign bits; IQ1_S, whose shift
is one a group, as a K-quant of 2-bit codes."""
import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

import tmac
from conftest import rel_l2, runnable_isas
from llama_fp64 import llama_logits
from tmac.base import reference as ref
from tmac.base.formats import FORMATS, IQ4_LEVELS
from tmac.execution.lut_ops import LutWeight, _workspace
from tmac.execution.packing import pack, unpack
from tmac.kernels import ISAS
from tmac.models.files.synthetic import CODEBOOK_TYPES, GRID_TYPES, k_quant_blocks
from tmac.quant.choose import spec_for
from tmac.quant.layout import GRID_TYPES as HELD_AS_GRIDS
from tmac.quant.quantize import import_gguf

RUNNABLE = runnable_isas()
# IQ4_NL/IQ4_XS on every ISA; the grid types' six kernels (levels × group size) on the best ISA, and a type of
# groups of 16 and one of 32 on the others with table lookups
CASES = [(isa, t) for isa in RUNNABLE for t in CODEBOOK_TYPES
         if (t == "IQ4_XS" or not isa.startswith("generic")) and
         (t not in GRID_TYPES or isa == RUNNABLE[0] or (t in ("IQ2_XS", "IQ3_XXS") and not isa.startswith("generic")))]


def codes_bytes(type_name: str, m: int, k: int) -> float:
    """The bytes of ``m × k`` weights of a grid type as 4-bit codes with a byte multiplier a group and a float16
    super scale a 256."""
    return m * k * (4 + 8 / FORMATS[type_name.lower()].group_size + 16 / 256) / 8


@pytest.mark.parametrize("type_name", CODEBOOK_TYPES)
def test_import_is_exact_and_keeps_the_codes(rng, type_name):
    m, k = 24, 512
    blocks = k_quant_blocks(rng, m, k, type_name)
    qw = import_gguf(blocks, type_name, (m, k))
    levels = FORMATS[type_name.lower()].codebook
    assert qw.format.codebook == levels and qw.format.bits == 4 and qw.zeros is None
    assert type_name in GRID_TYPES or levels == IQ4_LEVELS
    want = dequantize(blocks, gguf.GGMLQuantizationType[type_name]).reshape(m, k)
    np.testing.assert_array_equal(qw.dequantize(), want.astype(np.float32))
    assert qw.format.to_dict()["codebook"] == list(levels)
    assert tmac.WeightFormat.from_dict(qw.format.to_dict()) is FORMATS[type_name.lower()]
    used = np.unique(np.asarray(levels)[qw.codes])  # (random blocks reach every level a grid has)
    assert len(used) == {"IQ2": 6, "IQ1": 6}.get(type_name[:3], 16)


def test_iq1_s_imports_as_a_k_quant_of_two_bit_codes(rng):
    """IQ1_S: w = d·(2s + 1)·(grid ± ⅛) with one shift a group of 32, so codes grid + 1 of 2 bits, multipliers
    a = 2s + 1 and b = 7a or 9a of one super scale d and one d/8 (its K-quant form d·a·q − (d/8)·b), exactly the
    ``gguf`` package's weights; held at 2.625 bits a weight (codes, a byte of a and of b a group, d and d/8 a super
    group) instead of 4-bit codes' 4.31: 1.68x the file's 1.5625. The kernels: ``test_k_quant_super_scales``. Where
    the kernels expand grids it is held as its grid indices instead (``test_iq1_s_is_held_as_grid_indices...``)."""
    m, k = 256, 1024
    blocks = k_quant_blocks(rng, m, k, "IQ1_S")
    qw = import_gguf(blocks, "IQ1_S", (m, k))
    want = dequantize(blocks, gguf.GGMLQuantizationType.IQ1_S).reshape(m, k)
    np.testing.assert_array_equal(qw.dequantize(), want.astype(np.float32))
    fmt = qw.format
    assert (fmt.bits, fmt.group_size, fmt.has_zeros, fmt.codebook) == (2, 32, True, None)
    assert set(np.unique(qw.codes)) == {0, 1, 2}
    (a, d), (b, dmin) = qw.factors
    assert set(np.unique(a)) == set(range(1, 16, 2)) and np.array_equal(dmin, d / 8)
    assert ((b == 7 * a) | (b == 9 * a)).all() and (b == 7 * a).any() and (b == 9 * a).any()
    for isa in RUNNABLE:
        if ISAS[isa].expands_grids:
            continue
        spec = spec_for(qw, ISAS[isa])
        packed = pack(qw, spec)
        held = sum(x.nbytes for x in (packed.weights, packed.scales, packed.zeros))
        assert held * 8 / (m * k) == 2 + 8 / 32 + 8 / 32 + 2 * 16 / 256, isa
        assert held <= 1.7 * blocks.nbytes


def test_iq1_s_is_held_as_grid_indices_where_the_kernels_expand_grids(rng):
    """Where the kernels expand grids, IQ1_S is held as its 11-bit grid indices, its multiplier a = 2s + 1 a group
    of 32 with the group's shift in the multiplier byte's bits 4-7 (IQ1_M's codebook codes (grid + 1) | shift << 2,
    scale d·a/8), a float16 d/8 a 256: 1.6875 bits a weight, 1.08x the file's bytes. The kernels' sums are the
    reference's of that form (GEMV, few-row and dot-product GEMMs; where this CPU runs such kernels), within a
    rounding of the exact weights; and unpacking gives the import back, codes, parameters and factors alike."""
    from tmac.base.formats import IQ1_S_AS_CODES
    from tmac.execution.lut_ops import takes_dot_products
    from tmac.quant.held import held_weight

    m, k = 256, 1024
    blocks = k_quant_blocks(rng, m, k, "IQ1_S")
    qw = import_gguf(blocks, "IQ1_S", (m, k))
    spec = spec_for(qw, ISAS["avx512_vbmi"])  # (packing needs no such CPU)
    assert (spec.grid, spec.bits, spec.codebook, spec.has_zeros) == ("IQ1_S", 4, IQ1_S_AS_CODES.codebook, False)
    packed = pack(qw, spec)
    assert packed.zeros is None
    held = packed.weights.nbytes + packed.scales.nbytes
    assert held * 8 / (m * k) == 11 / 8 + 8 / 32 + 16 / 256 and held <= 1.08 * blocks.nbytes
    codes, _ = held_weight(qw, spec)
    assert codes.format is IQ1_S_AS_CODES
    np.testing.assert_array_equal(codes.dequantize(), qw.dequantize())  # the same weights, exactly
    exact_w = qw.dequantize().astype(np.float64)
    for isa in (isa for isa in RUNNABLE if ISAS[isa].expands_grids):
        lw = LutWeight(pack(qw, spec_for(qw, ISAS[isa])))
        for n in (1, 3, 20, 64):
            x = rng.standard_normal((n, k)).astype(np.float32)
            y = lw.matmul(torch.from_numpy(x)).numpy()
            dots = takes_dot_products(lw.spec, n)
            want = ref.dot_matmul(x, codes, lw.spec.activation_block) if dots else ref.lut_matmul(x, codes)
            assert rel_l2(y, want) <= 1e-5, (isa, n)
            assert rel_l2(want, x.astype(np.float64) @ exact_w.T) <= 0.02
    assert takes_dot_products(spec, 64)
    back = unpack(packed, qw.format)
    assert back.format is qw.format
    for got, expected in ((back.codes, qw.codes), (back.scales, qw.scales), (back.zeros, qw.zeros),
                          *zip((*back.factors[0], *back.factors[1]), (*qw.factors[0], *qw.factors[1]))):
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(got, expected)
    # a file packed for another ISA repacks through the import's form, both ways (a .tmac file moved between CPUs)
    two_bits = pack(qw, spec_for(qw, ISAS["avx2"]))
    for a, b in ((pack(unpack(two_bits, qw.format), spec), packed),
                 (pack(unpack(packed, qw.format), two_bits.spec), two_bits)):
        for x, y in ((a.weights, b.weights), (a.scales, b.scales), (a.zeros, b.zeros)):
            np.testing.assert_array_equal(x, y)
    bad = import_gguf(blocks, "IQ1_S", (m, k))
    bad.factors[1][0][7, 3] = 5 * bad.factors[0][0][7, 3]  # a shift IQ1_S does not have
    with pytest.raises(ValueError, match="group 3 of row 7 is not IQ1_S's"):
        pack(bad, spec)


@pytest.mark.parametrize("isa, type_name", CASES)
def test_kernels_match_the_reference_and_hold_the_files_bytes(rng, isa, type_name):
    """GEMV, few-row and tiled GEMMs (a partial last block) against the numpy reference of one table per activation
    (in bit-plane bytes, or quads where the ISA has 64-entry lookups);
    the reference itself against fp64; packing round-trips; the packed weights and scales are the file's bytes
    (IQ4_XS: 4.25 bits a weight, IQ4_NL: 4.5; the grid types their 4-bit codes', under 4.6) up to the last block's
    padding."""
    m, k = 200, 768
    blocks = k_quant_blocks(rng, m, k, type_name)
    qw = import_gguf(blocks, type_name, (m, k))
    spec = spec_for(qw, ISAS[isa])
    assert spec.codebook == qw.format.codebook and bool(spec.super_groups) == (type_name != "IQ4_NL")
    assert spec.quads == ISAS[isa].wide_lookup  # (64-entry lookups: four activations' tables at once; groups of 16 too)
    # IQ2_XXS where the kernels expand grids (AVX-512 VBMI): its indices and sign bits, the file's size
    assert spec.grid == (type_name if type_name in HELD_AS_GRIDS and ISAS[isa].expands_grids else "")
    packed = pack(qw, spec)
    held = sum(a.nbytes for a in (packed.weights, packed.scales))
    padding = spec.blocks(m) * spec.block_rows / m
    own = type_name not in GRID_TYPES or spec.grid
    assert held <= 1.15 * (blocks.nbytes if own else codes_bytes(type_name, m, k)) * padding
    lw = LutWeight(packed)
    exact_w = qw.dequantize().astype(np.float64)
    for n in (1, 3, 20):
        x = rng.standard_normal((n, k)).astype(np.float32)
        y = lw.matmul(torch.from_numpy(x)).numpy()
        want = ref.lut_matmul(x, qw)
        assert rel_l2(y, want) <= 1e-5
        assert rel_l2(want, x.astype(np.float64) @ exact_w.T) <= 0.02  # int8 tables: a step of max|x| a lut group
    back = unpack(packed, qw.format)
    np.testing.assert_array_equal(back.codes, qw.codes)
    np.testing.assert_array_equal(back.scales, qw.scales)
    # by default one K chunk but on 16-byte vectors (docs/decisions.md, "K chunks"); `tmac tune` may choose several:
    # the same sums
    assert spec.k_chunk == spec.k_padded or ISAS[isa].vector_bytes == 16
    chunked = LutWeight(pack(qw, spec_for(qw, ISAS[isa], k_chunk=2 * spec.chunk_unit)))
    x = rng.standard_normal((3, k)).astype(np.float32)
    for rows in (x[:1], x):
        assert rel_l2(chunked.matmul(torch.from_numpy(rows)).numpy(), ref.lut_matmul(rows, qw)) <= 1e-5


@pytest.mark.parametrize("isa", sorted({RUNNABLE[0], RUNNABLE[-1]}))
def test_super_scales_below_float16s_range_are_held_as_float16_times_a_power_of_two(rng, isa):
    """IQ2_XXS's super scale is llama.cpp's d/8, below float16's normal range where d < 2^−11 (as in real files): it
    is held as float16 d/8·2^e (``super_exponent``), not float32, and the kernels' sums are the reference's; the
    matrix at 1.12x the file's bytes (2 bits of indices and signs, a byte multiplier a 32, float16 a 256) where the
    kernels expand grids."""
    m, k = 128, 512
    blocks = k_quant_blocks(rng, m, k, "IQ2_XXS")
    blocks[:, :2] = (rng.uniform(1, 2, len(blocks)) * 2.0 ** -13).astype(np.float16).view(np.uint8).reshape(-1, 2)
    qw = import_gguf(blocks, "IQ2_XXS", (m, k))
    spec = spec_for(qw, ISAS[isa])
    assert (spec.scale_dtype, spec.super_exponent) == ("float16", 2)  # d/8·2^2 ≥ 2^−14, float16's least normal
    packed = pack(qw, spec)
    if spec.grid:
        held = sum(a.nbytes for a in (packed.weights, packed.scales))
        assert held * 8 / (m * k) == 2 + 8 / 32 + 16 / 256 and held <= 1.125 * blocks.nbytes
    back = unpack(packed, qw.format)
    np.testing.assert_array_equal(back.scales, qw.scales)
    lw = LutWeight(packed)
    for n in (1, 20):
        x = rng.standard_normal((n, k)).astype(np.float32)
        assert rel_l2(lw.matmul(torch.from_numpy(x)).numpy(), ref.lut_matmul(x, qw)) <= 1e-5


def test_iq1_m_grid_holds_its_shifts_in_the_multipliers(rng):
    """IQ1_M packed for AVX-512 VBMI (its grid indices; packing needs no such CPU): an entry's shift (−⅛ or +⅛, the
    codes' bit 2) is bit 4 + e of its group's multiplier byte, the multiplier 2s + 1 below it, so the matrix is the
    file's 1.75 bits a weight plus 0.25 (11 index bits an entry, a byte a 16, float16 a 256): 1.107x; packing and
    unpacking round-trip, and multipliers above 15 are refused by name."""
    from tmac.quant.kquant import factor_params

    m, k = 128, 512
    blocks = k_quant_blocks(rng, m, k, "IQ1_M")
    qw = import_gguf(blocks, "IQ1_M", (m, k))
    spec = spec_for(qw, ISAS["avx512_vbmi"])
    assert spec.grid == "IQ1_M"
    packed = pack(qw, spec)
    held = sum(a.nbytes for a in (packed.weights, packed.scales))
    assert held * 8 / (m * k) == 11 / 8 + 8 / 16 + 16 / 256 and held <= 1.11 * blocks.nbytes
    sg, bm = spec.super_groups, spec.block_rows
    mult = packed.scales.reshape(-1, (sg + spec.super_bytes) * bm)[:, :sg * bm].reshape(-1, sg, bm)  # [blk·S, G, BM]
    mult = mult.reshape(m // bm, k // (sg * 16), sg, bm).transpose(0, 3, 1, 2).reshape(m, k // 16).view(np.uint8)
    shifts = (qw.codes[:, ::8] >> 2) & 1  # an entry's
    np.testing.assert_array_equal(mult >> 4, shifts[:, 0::2] | shifts[:, 1::2] << 1)
    (a, d), zero = factor_params(qw, sg)
    np.testing.assert_array_equal(mult & 15, a)
    back = unpack(packed, qw.format)
    np.testing.assert_array_equal(back.codes, qw.codes)
    np.testing.assert_array_equal(back.scales, qw.scales)
    a = a.copy()
    a[3, 5] = 17
    with pytest.raises(ValueError, match="multipliers of this iq1_m weight exceed 15"):
        pack(qw, spec, factors=((a, d), zero))


@pytest.mark.parametrize("isa", [i for i in RUNNABLE if not i.startswith("generic")])
def test_tables_and_integer_sums_are_bit_exact(rng, isa):
    """The compiled table build gives the reference's int8 tables and scales (entry p of activation k's table:
    rint(c_p·x_k·127/amax)); with weight scale 1 and table scale 1 (an activation of 1 the largest of each lut
    group) the output is the reference's integer sums exactly."""
    m, k = 64, 256
    codes = rng.integers(0, 16, (m, k)).astype(np.uint8)
    fmt = FORMATS["iq4_nl"]
    qw = tmac.QuantizedWeight(codes, np.ones((m, k // 32), np.float32), None, fmt)
    lw = LutWeight.from_quantized(qw, isa=isa)
    x = rng.uniform(-1, 1, (1, k)).astype(np.float32)
    x[:, ::32] = 1.0
    y = lw.matmul(torch.from_numpy(x)).numpy()
    (lut, ls, _), _ = _workspace(lw.spec, 1)
    qt, rls = ref.quantize_tables(ref.build_codebook_tables(x, IQ4_LEVELS), lw.spec.lut_group, per_table=1)
    np.testing.assert_array_equal(lut.numpy()[:1], qt)
    np.testing.assert_array_equal(ls.numpy()[:1], rls)
    assert (rls == 1).all()
    np.testing.assert_array_equal(y[0], ref.lut_accumulate_codebook(qt, codes, lw.spec.lut_group)[0].sum(axis=1))


def test_a_codebook_token_table_looks_up_its_levels(rng):
    blocks = k_quant_blocks(rng, 40, 256, "IQ4_NL")
    qw = import_gguf(blocks, "IQ4_NL", (40, 256))
    table = tmac.Embedding(qw)
    want = dequantize(blocks, gguf.GGMLQuantizationType.IQ4_NL).reshape(40, 256)
    np.testing.assert_array_equal(table(torch.tensor([0, 7, 39])).numpy(), want[[0, 7, 39]])
    np.testing.assert_array_equal(table.row(5).numpy(), want[5])


@pytest.mark.parametrize("matrices, table, mixed", [("IQ4_XS", "IQ4_NL", ""), ("IQ4_NL", "Q6_K", ""),
                                                   ("IQ4_XS", "IQ4_XS", "Q5_K")])
def test_a_model_of_codebook_matrices_matches_the_fp64_forward(tmp_path, matrices, table, mixed):
    """Every projection at its own size (no 8-bit copy, no float one), an IQ4 token table kept as codes: logits
    within the bound the other exact types meet against an fp64 forward of the dequantized file (tests/llama_fp64.py),
    and the first greedy token (through the decode plan) is the exact model's where its top two are apart. The
    mix is llama.cpp's IQ4_XS ftype: attn_v and ffn_down at Q5_K, so one fused q|k|v holds codebook and bit-plane
    parts."""
    from tmac.models.family.llama import LlamaConfig
    from tmac.models.files.synthetic import write_random_gguf
    from tmac.nn.linear import Linear

    path = str(tmp_path / "m.gguf")
    cfg = LlamaConfig(vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=768, context_length=64)
    def type_of(name):
        if name.startswith(("token_embd", "output")):
            return table
        return mixed if mixed and name.endswith(("attn_v.weight", "ffn_down.weight")) else matrices

    write_random_gguf(path, cfg, type_of)
    model = tmac.load_model(path, kv_dtype="float32", progress=False)
    projections = [m for m in model.modules() if isinstance(m, Linear)]
    kinds = {m.format.name for m in projections[:-1]}
    assert kinds == ({matrices.lower(), mixed.lower()} if mixed else {matrices.lower()})
    assert all(bool(m.spec.codebook) == m.format.name.startswith("iq4") for m in projections[:-1])
    assert not any(type(m).__name__ == "FloatLinear" for m in model.modules())
    file_bytes = sum(t.n_bytes for t in gguf.GGUFReader(path).tensors if t.name.startswith("blk."))
    held = sum(b.nbytes for m in projections[:-1] for b in m.buffers())
    assert held <= 1.15 * file_bytes
    ids = [5, 77, 260, 261, 262, 13, 100, 200, 299, 42, 7, 150]
    got = tmac.Session(model).logits(ids).numpy().astype(np.float64)
    exact = llama_logits(path, ids)
    assert rel_l2(got, exact) <= 0.05
    session = tmac.Session(model)
    planned = session.generate(ids, max_tokens=8, temperature=0, ignore_eos=True)
    top2 = np.sort(exact[-1])[-2:]
    assert planned[0] == int(exact[-1].argmax()) or top2[1] - top2[0] < 6 * np.sqrt(((got - exact) ** 2).mean())


def test_a_spec_or_weight_whose_levels_disagree_is_refused(rng):
    """A kernel spec read from a file validates its levels; weights of one codebook do not pack or unpack for
    another's kernels (their tables would hold other products)."""
    import dataclasses

    from tmac.quant.spec import KernelSpec

    qw = import_gguf(k_quant_blocks(rng, 64, 256, "IQ4_NL"), "IQ4_NL", (64, 256))
    spec = spec_for(qw, ISAS["avx2"])
    record = spec.record()
    assert KernelSpec.from_dict(record) == spec and record["codebook"] == list(IQ4_LEVELS)
    from tmac.quant.choose import spec_for_format

    assert "codebook" not in spec_for_format(FORMATS["q4_0"], 256, ISAS["avx2"]).record()  # (planes: JSON as before)
    for bad in ([1] * 16, list(range(15)), "levels", [0.5] * 16):
        with pytest.raises(ValueError, match="codebook"):
            KernelSpec.from_dict({**record, "codebook": bad})
    with pytest.raises(ValueError, match="codebook kernels take"):
        dataclasses.replace(spec, triples=True)
    other = dataclasses.replace(spec, codebook=tuple(range(-8, 8)))
    with pytest.raises(ValueError):
        pack(qw, other)
    with pytest.raises(ValueError):
        unpack(pack(qw, spec), tmac.WeightFormat("cb", 4, 32, has_zeros=False, codebook=tuple(range(-8, 8))))
