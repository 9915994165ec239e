"""Compiled LUT kernels against the numpy reference, on every ISA this machine can run."""
import dataclasses
import json

import numpy as np
import pytest
import torch

from conftest import rel_l2, runnable_isas
from tmac import QuantizedWeight, WeightFormat, quantize_weight
from tmac.base import reference as ref
from tmac.kernels import ISAS
from tmac.base.cpu import machine_arch
from tmac.execution.lut_ops import LutWeight
from tmac.quant.choose import spec_for
from tmac.execution.packing import pack, unpack
from tmac.quant.spec import KernelSpec

RUNNABLE = runnable_isas()
FAST = [i for i in RUNNABLE if not i.startswith("generic")]


def _on_isas(cases: list, generic: list | None = None) -> list:
    """``(isa, *case)`` for every runnable ISA: every case on the fast ones; on the generic fallback, whose kernels
    compile ten times slower, only ``generic`` (default: the first case), marked slow (``make check`` leaves them
    to ``make test``)."""
    out = []
    for isa in RUNNABLE:
        for case in cases if isa in FAST else (generic or cases[:1]):
            values = (isa, *case) if isinstance(case, tuple) else (isa, case)
            out.append(pytest.param(*values, marks=pytest.mark.slow) if isa not in FAST else values)
    return out


ISAS_SLOW_GENERIC = [i if i in FAST else pytest.param(i, marks=pytest.mark.slow) for i in RUNNABLE]
ALL_BITS = [1, 2, 3, 4, 5, 6, 8]


@pytest.mark.parametrize("isa, bits", _on_isas(ALL_BITS, generic=[3]))
@pytest.mark.parametrize("group, zeros", [(32, True), (128, False), ("row", True), ("tensor", False)])
def test_float_output_matches_reference_epilogue(rng, isa, bits, group, zeros):
    m, k = 200, 512  # 200 rows: a partial last block
    w = rng.standard_normal((m, k)).astype(np.float32)
    qw = quantize_weight(w, bits=bits, group_size=group, symmetric=not zeros and bits > 1)
    if bits == 1 and not zeros:
        qw = QuantizedWeight(qw.codes, qw.scales, None, WeightFormat("w1s", 1, group, has_zeros=False))
    lw = LutWeight.from_quantized(qw, isa=isa, n_tile=3)
    for n in (1, 2, 5, 20):  # GEMV, GEMMs of a few rows and of many, with a padded last tile
        x = rng.standard_normal((n, k)).astype(np.float32)
        y = lw.matmul(torch.from_numpy(x)).numpy()
        assert y.shape == (n, m)
        assert rel_l2(y, ref.lut_matmul(x, qw)) <= 1e-5


@pytest.mark.parametrize("isa", FAST)
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 8])
def test_groups_of_16(rng, isa, bits):
    """Weight groups (and table scales) of 16 activations, as llama.cpp's Q2_K, Q3_K and Q6_K have, with plain
    float parameters: a lut group is two table pairs (one 2-bit quad step; 1-, 3- and 5-bit quad steps cover 32
    activations, so those take bit planes)."""
    m, k, zeros = 200, 256, bits % 2 == 1
    qw = quantize_weight(rng.standard_normal((m, k)).astype(np.float32), bits=bits, group_size=16, symmetric=not zeros)
    lw = LutWeight.from_quantized(qw, isa=isa)
    assert (lw.spec.group_size, lw.spec.lut_group) == (16, 16)
    assert lw.spec.quads == (ISAS[isa].wide_lookup and bits == 2)
    for n in (1, 3):
        x = rng.standard_normal((n, k)).astype(np.float32)
        assert rel_l2(lw.matmul(torch.from_numpy(x)).numpy(), ref.lut_matmul(x, qw)) <= 1e-5


@pytest.mark.parametrize("isa", ISAS_SLOW_GENERIC)
@pytest.mark.parametrize("scale_dtype, zero_dtype", [("float16", "float32"), ("float32", "float16"),
                                                     ("float32", "float32")])
def test_parameter_storage_dtypes(rng, isa, scale_dtype, zero_dtype):
    """Each of S and Z is read as stored, float16 or float32 (GGUF Q4_1 is float16 scales, float32 zeros)."""
    m, k = 72, 256
    w = rng.standard_normal((m, k)).astype(np.float32)
    qw = quantize_weight(w, bits=4, group_size=32)  # float16 values, so any storage holds them exactly
    fmt = WeightFormat("w4mixed", 4, 32, has_zeros=True, scale_dtype=scale_dtype, zero_dtype=zero_dtype)
    qw = QuantizedWeight(qw.codes, qw.scales, qw.zeros, fmt)
    lw = LutWeight.from_quantized(qw, isa=isa)
    assert (lw.scales.dtype, lw.zeros.dtype) == (getattr(torch, scale_dtype), getattr(torch, zero_dtype))
    x = rng.standard_normal((2, k)).astype(np.float32)
    assert rel_l2(lw.matmul(torch.from_numpy(x)).numpy(), ref.lut_matmul(x, qw)) <= 1e-5
    off = np.float32(1e-4)  # moves values off the float16 grid: a float16 storage must refuse them
    for bad, dtype in (((qw.scales + off, qw.zeros), scale_dtype), ((qw.scales, qw.zeros + off), zero_dtype)):
        if dtype == "float16":
            with pytest.raises(ValueError, match="not all exactly float16"):
                QuantizedWeight(qw.codes, *bad, fmt)


@pytest.mark.parametrize("isa, bits", _on_isas(ALL_BITS, generic=[4]))
def test_integer_part_is_bit_exact(rng, isa, bits):
    """With table scale 1 (amax = 127), weight scale 1 and zero −½ (bias term 0), y = Σ_g R_g exactly."""
    m, k, lg = 96, 256, 64
    fmt = WeightFormat(f"w{bits}exact", bits, lg, has_zeros=True)
    codes = rng.integers(0, 1 << bits, (m, k)).astype(np.uint8)
    qw = QuantizedWeight(codes, np.ones((m, k // lg), np.float32), np.full((m, k // lg), -0.5, np.float32), fmt)
    x = rng.integers(-40, 41, (3, k)).astype(np.float32) / 2
    x[:, ::lg] = 0
    x[:, 0:4 * (k // lg) * 16:16] = 0
    for g in range(k // lg):  # one run per group with |x| summing to 254: amax = 127 exactly
        x[:, g * lg:g * lg + 4] = [100.0, -80.0, 50.0, -24.0]
    qt, ls = ref.quantize_tables(ref.build_tables(x), lg)
    assert (ls == 1).all()
    r = ref.lut_accumulate(qt, codes, bits, lg).sum(axis=2)
    # 3 bits at 128 rows: two chunks of planes, and a GEMM block done in parts of rows (on 64-byte vectors)
    spec = spec_for(qw, ISAS[isa], **({"block_rows": 128} if bits == 3 else {}))
    assert spec.lut_group == lg
    y = LutWeight(pack(qw, spec)).matmul(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(y, r.astype(np.float32))
    y1 = LutWeight(pack(qw, spec)).matmul(torch.from_numpy(x[:1])).numpy()
    np.testing.assert_array_equal(y1[0], r[0].astype(np.float32))


@pytest.mark.parametrize("isa", FAST)
def test_tables_are_bit_exact(rng, isa):
    from tmac.execution.lut_ops import _workspace

    qw = quantize_weight(rng.standard_normal((64, 384)).astype(np.float32), bits=2, group_size=128)
    lw = LutWeight.from_quantized(qw, isa=isa)
    x = (rng.standard_normal((1, 384)) * 10).astype(np.float32)
    lw.matmul(torch.from_numpy(x))
    (lut, ls, _), _ = _workspace(lw.spec, 1)
    qt, rls = ref.quantize_tables(ref.build_tables(x), lw.spec.lut_group)
    np.testing.assert_array_equal(lut.numpy()[:1], qt)
    np.testing.assert_array_equal(ls.numpy()[:1], rls)


@pytest.mark.parametrize("isa, m, k, group", _on_isas([(200, 576, "row"), (72, 3200, "tensor"), (40, 320, "row")],
                                                     generic=[(40, 320, "row")]))
def test_triples_match_reference(rng, isa, m, k, group):
    """Ternary weights three to an index + sign: K = 3200 and 320 are padded to whole lut groups (3264, 384)."""
    qw = quantize_weight(rng.standard_normal((m, k)).astype(np.float32), ternary=True, group_size=group)
    # the default for per-row/per-tensor ternary weights where there are quads (elsewhere 2-bit planes are faster)
    assert spec_for(qw, ISAS[isa]).triples == (k != 320 and ISAS[isa].wide_lookup)
    lw = LutWeight.from_quantized(qw, isa=isa, n_tile=2, triples=True)
    assert lw.spec.triples and lw.weights.shape[1:] == (ref.padded_k(k) // 24, 5 * lw.spec.block_rows)
    for n in (1, 3):
        x = rng.standard_normal((n, k)).astype(np.float32)
        assert rel_l2(lw.matmul(torch.from_numpy(x)).numpy(), ref.lut_matmul_triples(x, qw)) <= 1e-5
    np.testing.assert_array_equal(unpack(pack(qw, lw.spec), qw.format).codes, qw.codes)


@pytest.mark.parametrize("isa", ISAS_SLOW_GENERIC)
def test_triples_integer_part_and_tables_are_bit_exact(rng, isa):
    """Scale 1 and a table scale of 1 (each lut group's largest |x0|+|x1|+|x2| is 127): y = Σ_g R_g exactly."""
    from tmac.execution.lut_ops import _workspace

    m, k = 96, 320  # padded to 384: two lut groups, the second one part padding
    codes = rng.integers(1, 4, (m, k)).astype(np.uint8)
    qw = QuantizedWeight(codes, np.ones((m, 1), np.float32), None, WeightFormat.ternary_format("row"))
    x = rng.integers(-40, 41, (3, k)).astype(np.float32) / 2  # any triple sums to at most 60 in magnitude
    for g in range(2):
        x[:, g * 192:g * 192 + 3] = [100.0, -20.0, 7.0]
    kp = ref.padded_k(k)
    qt, ls = ref.quantize_tables(ref.build_triple_tables(x, kp), ref.TRIPLE_LUT_GROUP, per_table=3)
    assert (ls == 1).all()
    r = ref.lut_accumulate_triples(qt, *ref.triple_indices(codes, kp), ref.TRIPLE_LUT_GROUP).sum(axis=2)
    assert not spec_for(qw, ISAS[isa]).triples  # by default: padding 320 to 384 would cost what triples save
    lw = LutWeight.from_quantized(qw, isa=isa, triples=True)
    np.testing.assert_array_equal(lw.matmul(torch.from_numpy(x)).numpy(), r.astype(np.float32))
    np.testing.assert_array_equal(lw.matmul(torch.from_numpy(x[1:2])).numpy()[0], r[1].astype(np.float32))
    (lut, ls_out, _), _ = _workspace(lw.spec, 1)
    np.testing.assert_array_equal(lut.numpy()[0], qt[1])
    np.testing.assert_array_equal(ls_out.numpy()[0], ls[1])


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_close_to_fp64_at_llama_shape(rng, bits):
    k = 4096
    qw = quantize_weight(rng.standard_normal((256, k)).astype(np.float32), bits=bits, group_size=128)
    x = rng.standard_normal((1, k)).astype(np.float32)
    y = LutWeight.from_quantized(qw).matmul(torch.from_numpy(x)).numpy()
    assert rel_l2(y, x.astype(np.float64) @ qw.dequantize().astype(np.float64).T) <= 0.015


@pytest.mark.parametrize("m, k", [(576, 576), (192, 576), (1536, 576), (576, 1536), (3200, 8640)])
def test_real_model_shapes(rng, m, k):
    qw = quantize_weight(rng.standard_normal((m, k)).astype(np.float32), bits=2, group_size=64)
    x = rng.standard_normal((2, k)).astype(np.float32)
    y = LutWeight.from_quantized(qw).matmul(torch.from_numpy(x)).numpy()
    assert rel_l2(y, ref.lut_matmul(x, qw)) <= 1e-5


def test_misuse_raises_before_any_kernel_runs(rng):
    qw = quantize_weight(rng.standard_normal((64, 256)).astype(np.float32), bits=2, group_size=32)
    lw = LutWeight.from_quantized(qw)
    good = torch.randn(2, 256)
    with pytest.raises(TypeError, match="float32"):
        lw.matmul(good.double())
    with pytest.raises(TypeError, match="torch.Tensor"):
        lw.matmul(good.numpy())
    with pytest.raises(ValueError, match=r"shape \[N, 256\]"):
        lw.matmul(torch.randn(2, 128))
    with pytest.raises(ValueError, match=r"shape \[N, 256\]"):
        lw.matmul(torch.randn(256))
    with pytest.raises(ValueError, match="contiguous"):
        lw.matmul(torch.randn(256, 2).t())
    with pytest.raises(ValueError, match="out must be"):
        lw.matmul(good, out=torch.empty(2, 63))
    assert lw.matmul(torch.empty(0, 256)).shape == (0, 64)
    # an unaligned (offset by one float) but contiguous view works: buffers are declared unaligned
    base = torch.randn(2 * 256 + 1)
    x = base[1:].view(2, 256)
    assert x.data_ptr() % 64 != 0
    np.testing.assert_allclose(lw.matmul(x).numpy(), lw.matmul(x.clone()).numpy())


def test_raw_kernel_checks_shapes(rng):
    qw = quantize_weight(rng.standard_normal((64, 256)).astype(np.float32), bits=2, group_size=32)
    lw = LutWeight.from_quantized(qw)
    kern = lw.kernels
    with pytest.raises((ValueError, TypeError)):
        kern.build_tables(torch.randn(1, 128), torch.empty(1, 64, 16, dtype=torch.int8), torch.empty(1, 8),
                          torch.empty(1, 8))


@pytest.mark.parametrize("isa, type_name", _on_isas(["Q4_K", "Q5_K", "Q2_K", "Q3_K", "Q6_K", "IQ1_S"]))
def test_k_quant_super_scales(rng, isa, type_name):
    """K-quants' scales d·a and zeros dmin·b − offset·d·a stream as byte multipliers of one float16 per 256 weights,
    llama.cpp's d and dmin (Q4_K: 4.625 bits a weight instead of 6; Q6_K: signed multipliers, no zeros, 6.5625 as
    in the file), or of one float32 where those are not float16 values: GEMV and GEMM match the reference
    epilogue, a partial last block, an all-zero super group and a negative dmin included; packing round-trips
    exactly; parameters that do not factor so get plain float32 storage."""
    from tmac.models.files.synthetic import k_quant_blocks
    from tmac.quant.kquant import factor_params
    from tmac.quant.quantize import import_gguf

    m, k = 200, 512
    qw = import_gguf(k_quant_blocks(rng, m, k, type_name), type_name, (m, k))
    fmt, supers = qw.format, 256 // qw.format.group_size
    scales, zeros = qw.scales.copy(), None if qw.zeros is None else qw.zeros.copy()
    scales[3, :supers] = 0
    if zeros is not None:
        zeros[3, :supers] = 0
        zeros[5] = -(zeros[5] + fmt.offset * scales[5]) - fmt.offset * scales[5]  # dmin·b negated
    qw = QuantizedWeight(qw.codes, scales, zeros, fmt)
    (a, d), zero_factors = factor_params(qw)
    # d of 13 significant bits (a power of two times 4099/4096, 4099 a prime): no float16 base, float32 d·a
    d13 = (np.exp2(np.round(np.log2(np.where(d == 0, 1, np.abs(d))))) * np.sign(d) * (4099 / 4096)).astype(np.float32)
    s13 = np.repeat(d13, supers, axis=1) * a.astype(np.float32)
    z13 = None if zeros is None else \
        np.repeat(zero_factors[1], supers, axis=1) * zero_factors[0].astype(np.float32) - np.float32(fmt.offset) * s13
    two_bits = {"grid": ""} if type_name == "IQ1_S" else {}  # (its K-quant form: these are no IQ1_S parameters)
    for weight, halves in ((qw, True), (QuantizedWeight(qw.codes, s13, z13, fmt), False)):
        spec = spec_for(weight, ISAS[isa], **two_bits)
        assert spec.super_groups == supers and spec.super_bytes == (2 if halves else 4)
        with pytest.raises(ValueError, match="even count"):  # the kernels take a super group's lut groups in pairs
            dataclasses.replace(spec, super_groups=1)
        packed = pack(weight, spec)
        assert packed.scales.dtype == (np.uint8 if fmt.has_zeros else np.int8)
        assert packed.scales.nbytes == spec.blocks(m) * spec.block_rows * k * (supers + spec.super_bytes) // 256
        lw = LutWeight(packed)
        for n in (1, 2, 5, 20):
            x = rng.standard_normal((n, k)).astype(np.float32)
            assert rel_l2(lw.matmul(torch.from_numpy(x)).numpy(), ref.lut_matmul(x, weight)) <= 1e-5
        back = unpack(packed, fmt)
        for got, want in ((back.codes, weight.codes), (back.scales, weight.scales), (back.zeros, weight.zeros)):
            np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="not all float16"):
        pack(weight, dataclasses.replace(spec, scale_dtype="float16", zero_dtype="float16"))
    qw = QuantizedWeight(qw.codes, scales, zeros, fmt)
    odd = QuantizedWeight(qw.codes, rng.uniform(0.01, 0.02, scales.shape).astype(np.float32), zeros, fmt)
    assert spec_for(odd, ISAS[isa]).super_groups == 0
    with pytest.raises(ValueError, match="not multiples of one float32"):
        pack(odd, spec)
    plain = LutWeight(pack(odd, spec_for(odd, ISAS[isa])))
    x = rng.standard_normal((2, k)).astype(np.float32)
    assert rel_l2(plain.matmul(torch.from_numpy(x)).numpy(), ref.lut_matmul(x, odd)) <= 1e-5


@pytest.mark.parametrize("isa", FAST)
@pytest.mark.parametrize("kind", ["w4g32", "w2g128", "w1g64", "w3row", "ternary", "Q4_K"])
def test_k_chunks_reorder_rows_and_keep_results_bit_exact(rng, isa, kind):
    """K cut into chunks (the last shorter) stores each chunk's rows of every block before the next chunk's —
    checked row by row against the one-chunk packing — and the kernels give bit-identical GEMV and GEMM
    results (later chunks go on from Y, so the float sums keep their order); packing round-trips."""
    from tmac.models.files.synthetic import k_quant_blocks
    from tmac.quant.quantize import import_gguf

    m, k = 200, 2304
    if kind == "Q4_K":
        qw = import_gguf(k_quant_blocks(rng, m, k, kind), kind, (m, k))
    else:
        w = rng.standard_normal((m, k)).astype(np.float32)
        groups = {"g32": 32, "g64": 64, "g128": 128, "row": "row"}
        qw = quantize_weight(w, ternary=True, group_size="row") if kind == "ternary" else \
            quantize_weight(w, bits=int(kind[1]), group_size=groups[kind[2:]])
    whole = spec_for(qw, ISAS[isa], k_chunk=ref.padded_k(k) if kind == "ternary" else k)
    unit = whole.chunk_unit
    chunked = spec_for(qw, ISAS[isa], k_chunk=unit * 5 if whole.k_padded // unit > 5 else unit)
    assert whole.k_padded // unit > 1 and whole.k_padded % chunked.k_chunk  # several chunks, a short last one
    one, cut = pack(qw, whole), pack(qw, chunked)
    for a, b in ((one.weights, cut.weights), (one.scales, cut.scales), (one.zeros, cut.zeros)):
        if a is None or a.shape[1] == 1:
            assert b is None or np.array_equal(a, b)
            continue
        mb, rows = a.shape[:2]
        per = rows * chunked.k_chunk // chunked.k_padded
        flat = b.reshape(mb * rows, -1)
        for r in range(rows):  # row r of block blk lies in the chunk starting at r0 = r - r % per
            r0 = r - r % per
            rc = min(per, rows - r0)
            for blk in (0, mb - 1):
                np.testing.assert_array_equal(flat[mb * r0 + blk * rc + r - r0], a[blk, r])
    back = unpack(cut, qw.format)
    np.testing.assert_array_equal(back.codes, qw.codes)
    np.testing.assert_array_equal(back.scales, qw.scales)
    x = torch.from_numpy(rng.standard_normal((5, k)).astype(np.float32))
    for n in (1, 5):
        assert torch.equal(LutWeight(cut).matmul(x[:n]), LutWeight(one).matmul(x[:n]))
    for bad in (unit // 2, whole.k_padded + unit, -unit):
        with pytest.raises(ValueError, match=f"k_chunk={bad} must be a positive multiple of {unit}"):
            spec_for(qw, ISAS[isa], k_chunk=bad)
    saved = json.loads(chunked.to_json())
    del saved["k_chunk"]  # a spec saved before K chunks: one chunk, the layout it was packed in
    assert KernelSpec.from_dict(saved).k_chunk == whole.k_padded


@pytest.mark.parametrize("isa", FAST)
@pytest.mark.parametrize("kind", ["w4g32", "w2g128", "ternary", "Q4_K"])
def test_a_rows_output_is_the_same_alone_among_few_rows_and_among_many(rng, isa, kind):
    """Up to ``FEW_ROWS`` rows the GEMM looks up every row tile of a block while its weights are loaded, past that
    one tile after another; either way, and in the GEMV, each row's float sums run in one order: its output is the
    same bit for bit (what a decode step of several sequences relies on)."""
    from tmac.codegen.lut import FEW_ROWS
    from tmac.models.files.synthetic import k_quant_blocks
    from tmac.quant.quantize import import_gguf

    m, k = 136, 768  # a partial last block
    if kind == "Q4_K":
        qw = import_gguf(k_quant_blocks(rng, m, k, kind), kind, (m, k))
    else:
        w = rng.standard_normal((m, k)).astype(np.float32)
        qw = quantize_weight(w, ternary=True, group_size="row") if kind == "ternary" else \
            quantize_weight(w, bits=int(kind[1]), group_size=int(kind[3:]))
    lw = LutWeight.from_quantized(qw, isa=isa)
    x = torch.from_numpy(rng.standard_normal((FEW_ROWS + 3, k)).astype(np.float32))
    many = lw.matmul(x)
    few = lw.matmul(x[:FEW_ROWS - 1])
    oracle = ref.lut_matmul_triples if lw.spec.triples else ref.lut_matmul
    assert rel_l2(many.numpy(), oracle(x.numpy(), qw)) <= 1e-5
    assert torch.equal(few, many[:FEW_ROWS - 1])
    for r in (0, 5, FEW_ROWS + 2):
        assert torch.equal(lw.matmul(x[r:r + 1])[0], many[r])


@pytest.mark.parametrize("kind", ["w1", "w2", "w3", "w5", "ternary"])
def test_quads_layout_round_trips_and_is_what_low_bit_weights_get(rng, kind):
    """1- to 3-bit weights and triples on an ISA with 64-entry lookups are packed as quads; packing is exactly
    invertible, rows past M included (a partial last block); 4 bits and other ISAs keep the bit-plane layout."""
    m, k = 200, 3200
    w = rng.standard_normal((m, k)).astype(np.float32)
    ternary = kind == "ternary"
    qw = quantize_weight(w, ternary=True, group_size="row") if ternary else \
        quantize_weight(w, bits=int(kind[1]), group_size=64)
    spec = spec_for(qw, ISAS["avx512_vbmi"])
    assert spec.quads and spec.triples == ternary and spec.block_rows == (64 if kind in ("w3", "ternary") else 128)
    packed = pack(qw, spec)
    steps = ref.padded_k(k) // 24 if ternary else k // 16 if kind == "w2" else k // 32
    row_bytes = {"w1": 4, "w2": 4, "w3": 12, "w5": 20, "ternary": 5}[kind]  # per step
    assert packed.weights.shape == (-(-m // spec.block_rows), steps, row_bytes * spec.block_rows)

    def nib(plane, t):  # the plane's index into table t of row 1: bit j is that bit of code 4t + j
        return sum(((int(qw.codes[1, 4 * t + j]) >> plane) & 1) << j for j in range(4))
    # the layout's statement, read back by hand: row 1, step 3, byte 4 + p of each quad chunk
    if kind == "w2":  # p = 3: plane 1 of table 1 of the step's four (low nibble), table 3 (high)
        assert packed.weights[0, 3, 4 + 3] == nib(1, 4 * 3 + 1) | (nib(1, 4 * 3 + 2 + 1) << 4)
    if kind == "w3":  # planes 0-1 of tables 0-3 and 4-7 of the step's eight, then plane 2 of all eight
        bm = spec.block_rows
        assert packed.weights[0, 3, 4 * bm + 4 + 3] == nib(1, 8 * 3 + 4 + 1) | (nib(1, 8 * 3 + 4 + 2 + 1) << 4)
        assert packed.weights[0, 3, 8 * bm + 4 + 2] == nib(2, 8 * 3 + 2) | (nib(2, 8 * 3 + 4 + 2) << 4)
    back = unpack(packed, qw.format)
    np.testing.assert_array_equal(back.codes, qw.codes)
    np.testing.assert_array_equal(back.scales, qw.scales)
    assert not spec_for(qw, ISAS["avx512_vnni"]).quads
    assert not spec_for(quantize_weight(w, bits=4), ISAS["avx512_vbmi"]).quads


@pytest.mark.skipif(machine_arch() != "x86_64", reason="x86 code generation is inspected on x86 hosts")
@pytest.mark.parametrize("isa, bits, needle", [("avx512_vnni", 4, "vpdpbusd\t%zmm"), ("avx512", 4, "vpmaddubsw\t%zmm"),
                                               ("avx2_vnni", 4, "vpdpbusd"), ("avx2", 4, "vpshufb\t%ymm"),
                                               ("avx512_vbmi", 1, "vpermb\t%zmm"), ("avx512_vbmi", 2, "vpermb\t%zmm"),
                                               ("avx512_vbmi", 3, "vpermb\t%zmm")])
def test_every_x86_variant_compiles_to_its_instructions(isa, bits, needle):
    """Variants this CPU cannot run are still generated and checked in assembly."""
    from tmac.codegen.build import compile_kernel

    target = ISAS[isa]
    qw = quantize_weight(np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32), bits=bits)
    assert qw.format.scale_dtype == "float16"
    asm = compile_kernel(spec_for(qw, target), target).mod.inspect_source("asm")
    assert needle in asm
    assert ("vpshufb" in asm) == (isa != "avx512_vbmi")  # quads look up with vpermb only
    assert "vcvtph2ps" in asm  # float16 parameters widen in registers
