import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import rel_l2, smollm2_path
from tmac import import_gguf, quantize_weight
from tmac.base.errors import InexactImport

pytestmark = pytest.mark.unit  # needs no compiler (make unit)


@pytest.mark.parametrize("bits, bound", [(1, 0.62), (2, 0.42), (3, 0.19), (4, 0.09), (5, 0.045)])
def test_asymmetric_min_max_error_bounds(rng, bits, bound):
    w = rng.standard_normal((64, 512)).astype(np.float32)
    qw = quantize_weight(w, bits=bits, group_size=32, search=False)
    deq = qw.dequantize()
    assert rel_l2(deq, w) < bound
    if bits > 1:  # round-to-nearest inside [min, max]: every weight within half a step
        step = np.repeat(qw.scales, 32, axis=1)
        assert (np.abs(deq - w) <= 0.5 * step * (1 + 1e-5) + 1e-7).all()


@pytest.mark.parametrize("bits, bound", [(2, 0.33), (3, 0.16), (4, 0.076), (5, 0.038)])
def test_asymmetric_search_beats_min_max_in_every_group(rng, bits, bound):
    """The default search never loses to min/max in a group by its measure — squared errors weighted by llama.cpp's
    importance of a weight, the group's rms plus the weight's magnitude — up to the float16 rounding of both
    formats' parameters (≤ 0.3 % at 5 bits), and gains in plain relative error too."""
    w = rng.standard_normal((64, 512)).astype(np.float32)
    g = w.reshape(64, 16, 32)
    importance = np.sqrt(np.square(g).mean(axis=2, keepdims=True)) + np.abs(g)
    found, plain = (quantize_weight(w, bits=bits, group_size=32, search=s).dequantize() for s in (True, False))
    loss = [(importance * np.square(d.reshape(g.shape) - g)).sum(axis=2) for d in (found, plain)]
    assert (loss[0] <= loss[1] * 1.01).all()
    assert rel_l2(found, w) < bound < rel_l2(plain, w)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # no overflow inside the search
def test_asymmetric_search_skips_groups_too_large_for_float32_squares(rng):
    """Weights of 1e36 (float64 input): the search's float32 squares would overflow, so those groups keep their
    min and max — finite, exactly what ``search=False`` gives, and without numpy's overflow warnings."""
    w = rng.standard_normal((4, 64)) * 1e36
    qw = quantize_weight(w, bits=2, group_size=32)
    plain = quantize_weight(w, bits=2, group_size=32, search=False)
    assert np.isfinite(qw.dequantize()).all() and rel_l2(qw.dequantize(), w) < 0.42
    assert np.array_equal(qw.codes, plain.codes) and np.array_equal(qw.scales, plain.scales)


def test_asymmetric_search_keeps_groups_min_max_fits_exactly(rng):
    """Weights on a 2-bit grid of their groups' min and max (its four levels all used): the search finds that
    grid, not a shrunk one."""
    codes = np.tile(np.arange(4), (8, 16))  # [8, 64]: every group of 32 uses every level
    rng.shuffle(codes, axis=1)
    s = rng.uniform(0.5, 2, (8, 2)).astype(np.float16).astype(np.float64)
    lo = rng.uniform(-3, -1, (8, 2)).astype(np.float16).astype(np.float64)
    w = (np.repeat(lo, 32, axis=1) + np.repeat(s, 32, axis=1) * codes).astype(np.float32)
    qw = quantize_weight(w, bits=2, group_size=32)
    np.testing.assert_allclose(qw.dequantize(), w, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(qw.scales, s, rtol=2.0 ** -10)


@pytest.mark.parametrize("bits, bound", [(2, 0.45), (3, 0.2), (4, 0.1), (5, 0.05)])
def test_symmetric_error_bounds(rng, bits, bound):
    w = rng.standard_normal((64, 512)).astype(np.float32)
    qw = quantize_weight(w, bits=bits, group_size=64, symmetric=True)
    assert qw.zeros is None
    assert rel_l2(qw.dequantize(), w) < bound
    # the largest-magnitude weight of each group is represented up to its float16 scale (llama.cpp's sign trick)
    g = w.reshape(64, 8, 64)
    i = np.abs(g).argmax(axis=2)
    np.testing.assert_allclose(np.take_along_axis(qw.dequantize().reshape(64, 8, 64), i[..., None], 2),
                               np.take_along_axis(g, i[..., None], 2), rtol=2.0 ** -11)


@pytest.mark.parametrize("symmetric", [False, True])
def test_round_to_nearest_parameters_are_float16(rng, symmetric):
    w = rng.standard_normal((32, 256)).astype(np.float32)
    qw = quantize_weight(w, bits=3, group_size=64, symmetric=symmetric)
    assert qw.format.scale_dtype == "float16" and qw.format.name == f"w3g64{'s' if symmetric else ''}"
    for p in (qw.scales, qw.zeros):
        if p is not None:
            assert np.array_equal(p.astype(np.float16).astype(np.float32), p)
    # the codes are the nearest levels of the stored (rounded) grid: no other code is closer to w
    s, z = np.repeat(qw.scales.astype(np.float64), 64, axis=1), 0 if symmetric else np.repeat(qw.zeros, 64, axis=1)
    level = lambda q: s * (q - 4.0) - z  # noqa: E731
    best = np.abs(level(qw.codes.astype(np.float64)) - w)
    for q in range(8):
        assert (best <= np.abs(level(np.full(w.shape, q)) - w) + 1e-9).all()


def test_scales_float16_cannot_hold_fall_back_to_float32(rng):
    w = (rng.standard_normal((4, 64)) * 1e-7).astype(np.float32)  # steps below float16's normal range; × 1e13 above its max
    qw = quantize_weight(w, bits=2, group_size=32)
    assert (qw.format.name, qw.format.scale_dtype, qw.format.zero_dtype) == ("w2g32f32", "float32", "float32")
    assert rel_l2(qw.dequantize(), w) < 0.42
    big = quantize_weight(w * 1e13, bits=4, group_size=32, symmetric=True)
    assert big.format.scale_dtype == "float32" and rel_l2(big.dequantize(), w * 1e13) < 0.1


@pytest.mark.parametrize("fmt", [dict(bits=2), dict(bits=1), dict(bits=4, symmetric=True), dict(bits=3, group_size=64),
                                 dict(ternary=True, group_size="row"), dict(bits=2, group_size="row")])
def test_large_matrices_quantize_in_row_slices_exactly_as_whole(rng, monkeypatch, fmt):
    """Row slices bound the float64 temporaries (a 49152-row head would need gigabytes); they must not change a
    single code or parameter — also where one slice's scales fall out of float16 and the whole matrix decides."""
    import tmac.quant.quantize as q

    w = rng.standard_normal((96, 256)).astype(np.float32)
    w[70:72] *= 1e6 if fmt.get("bits") == 2 and "group_size" not in fmt else 1  # beyond float16 in one slice only
    whole = quantize_weight(w, **fmt)
    monkeypatch.setattr(q, "QUANTIZE_CHUNK", 256 * 32)  # slices of 32 rows
    sliced = quantize_weight(w, **fmt)
    assert sliced.format == whole.format
    assert np.array_equal(sliced.codes, whole.codes) and np.array_equal(sliced.scales, whole.scales)
    assert (sliced.zeros is None) == (whole.zeros is None)
    assert sliced.zeros is None or np.array_equal(sliced.zeros, whole.zeros)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_tensors_quantize_as_their_float32_values(rng, monkeypatch, dtype):
    """A 16-bit torch weight (a bfloat16 head) is widened a slice at a time, with the codes of its float32 copy;
    a NaN in any slice is still found."""
    import tmac.quant.quantize as q

    monkeypatch.setattr(q, "QUANTIZE_CHUNK", 256 * 32)  # slices of 32 rows
    w = torch.from_numpy(rng.standard_normal((96, 256)).astype(np.float32)).to(dtype)
    for fmt in (dict(bits=2), dict(bits=4, symmetric=True), dict(ternary=True, group_size="row")):
        a, b = quantize_weight(w, **fmt), quantize_weight(w.float(), **fmt)
        assert a.format == b.format and np.array_equal(a.codes, b.codes) and np.array_equal(a.scales, b.scales)
    w[70, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize_weight(w)


def test_ternary_matches_bitnet_reference_formula(rng):
    w = torch.from_numpy(rng.standard_normal((32, 256)).astype(np.float32))
    # BitNet b1.58 weight_quant, written independently of tmac
    scale = 1.0 / w.abs().mean().clamp_(min=1e-5)
    expected = (w * scale).round().clamp_(-1, 1) / scale
    qw = quantize_weight(w, ternary=True, group_size="tensor")
    assert set(np.unique(qw.codes)) <= {1, 2, 3}
    np.testing.assert_allclose(qw.dequantize(), expected.numpy(), rtol=1e-6, atol=1e-7)


def test_per_row_and_per_tensor(rng):
    w = rng.standard_normal((16, 96)).astype(np.float32)
    assert quantize_weight(w, bits=4, group_size="row").scales.shape == (16, 1)
    assert quantize_weight(w, bits=4, group_size="tensor").scales.shape == (1, 1)


def _same_bits(a, b):
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32))


def test_gguf_q4_1_import_is_exact_on_smollm2():
    reader = gguf.GGUFReader(smollm2_path())
    tensors = [t for t in reader.tensors if t.tensor_type.name == "Q4_1"]
    assert len(tensors) == 210
    half = 0
    for i, t in enumerate(tensors):
        shape = tuple(int(d) for d in reversed(t.shape))
        qw = import_gguf(t.data, "Q4_1", shape)
        if i % 7 == 0:
            assert _same_bits(qw.dequantize(), dequantize(t.data, t.tensor_type).reshape(shape)), t.name
        half += qw.format.zero_dtype == "float16"
    assert half == 208  # −(m + 8d) is a float16 value in all blocks of all tensors but two


def test_gguf_q4_1_zeros_are_float16_only_where_every_one_is():
    """Q4_1's zero −(m + 8d) is stored as float16 when, in the whole tensor, it is a float16 value; else float32;
    a zero that is not even a float32 value is no exact import."""
    def q4_1(blocks):  # (d, m) per block, codes 0..15 in order
        return b"".join(np.array([d, m], np.float16).tobytes() + bytes((2 * j) | (2 * j + 1) << 4 for j in range(8))
                        + bytes(8) for d, m in blocks)

    exact = import_gguf(q4_1([(0.5, -4.0), (0.25, -1.5)]), "Q4_1", (2, 32))
    assert exact.format.zero_dtype == "float16"
    wide = import_gguf(q4_1([(0.5, -4.0), (1000.0, 0.5)]), "Q4_1", (2, 32))  # −8000.5: float32, not float16
    assert wide.format.zero_dtype == "float32"
    for qw, params in ((exact, [(0.5, -4.0), (0.25, -1.5)]), (wide, [(0.5, -4.0), (1000.0, 0.5)])):
        ref = dequantize(np.frombuffer(q4_1(params), np.uint8).reshape(2, 20), gguf.GGMLQuantizationType.Q4_1)
        assert _same_bits(qw.dequantize(), ref.reshape(2, 32))
    with pytest.raises(InexactImport, match="row 1 is not a float32 value"):  # −(8000 + 2^-14)
        import_gguf(q4_1([(0.5, -4.0), (1000.0, 2.0 ** -14)]), "Q4_1", (2, 32))


@pytest.fixture(params=["whole", "row slices"])
def import_slices(request, monkeypatch):
    """Imports decode in row slices (bounding their temporaries); at 2 rows a slice every check sees several."""
    import tmac.quant.quantize as q

    if request.param == "row slices":
        monkeypatch.setattr(q, "QUANTIZE_CHUNK", 2 * 512)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "TQ1_0", "TQ2_0"])
def test_gguf_import_is_exact_on_quantized_blocks(rng, type_name, import_slices):
    qtype = gguf.GGMLQuantizationType[type_name]
    w = rng.standard_normal((6, 512)).astype(np.float32) * rng.uniform(0.01, 3, (6, 1)).astype(np.float32)
    blocks = quantize(w, qtype)
    qw = import_gguf(blocks, type_name, w.shape)
    assert _same_bits(qw.dequantize(), dequantize(blocks, qtype))


@pytest.mark.parametrize("type_name, bits, group", [("Q4_K", 4, 32), ("Q5_K", 5, 32), ("Q2_K", 2, 16), ("Q3_K", 3, 16),
                                                    ("Q6_K", 6, 16)])
def test_gguf_k_quant_import_is_exact(rng, import_slices, type_name, bits, group):
    """llama.cpp's K-quants: 256 weights a block in groups of 32 (Q4_K, Q5_K) or 16, each group with its own scale
    multiplier (4 to 8 bits; signed in Q3_K and Q6_K) and, in Q2_K, Q4_K and Q5_K, min multiplier; the codes' high
    bits apart in Q3_K, Q5_K and Q6_K. Random blocks: every bit pattern of the codes and multipliers occurs."""
    from tmac.models.files.synthetic import k_quant_blocks

    blocks = k_quant_blocks(rng, 6, 512, type_name)
    qw = import_gguf(blocks, type_name, (6, 512))
    assert (qw.format.bits, qw.format.group_size, qw.scales.shape) == (bits, group, (6, 512 // group))
    assert _same_bits(qw.dequantize(), dequantize(blocks, gguf.GGMLQuantizationType[type_name]))
    assert set(np.unique(qw.codes)) == set(range(1 << bits))
    if not qw.format.has_zeros:
        return
    d_at = 80 if type_name == "Q2_K" else 0
    halves = blocks.copy().reshape(6, 2, -1)  # d a power of two, dmin 0: every zero −offset·d·a is a float16 value
    halves[:, :, d_at:d_at + 4] = np.frombuffer(np.float16([2.0 ** -10, 0.0]).tobytes(), np.uint8)
    qw = import_gguf(halves.reshape(6, -1), type_name, (6, 512))
    assert qw.format.super_group == 256  # byte multipliers stream less than float16 zeros would
    assert _same_bits(qw.dequantize(), dequantize(halves.reshape(6, -1), gguf.GGMLQuantizationType[type_name]))
    extreme = blocks.copy()  # a min 2^15 times the scale: dmin·b − offset·d·a needs more than float32's 24 bits
    extreme[5, d_at:d_at + 4] = np.frombuffer(np.float16([1.2345e-4, 4.0]).tobytes(), np.uint8)
    with pytest.raises(InexactImport, match="row 5"):
        import_gguf(extreme, type_name, (6, 512))


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_S"])
def test_k_quant_imports_keep_the_files_multipliers(rng, monkeypatch, type_name):
    """A K-quant import carries the file's integer multipliers and d, dmin (``factors``) instead of factoring its float
    scales again: they give the scales and zeros exactly in float32 as the kernels compute them, as the factoring
    of the floats does; they follow a row permutation (the GGUF loader's q/k un-permuting) and a fused stack; and a
    matrix whose codes stay in the file (streamed: only its parameters are read at import) imports exactly."""
    import dataclasses

    import tmac.quant.quantize as q
    from tmac.base.qweight import stack_rows
    from tmac.models.files.synthetic import k_quant_blocks
    from tmac.quant.kquant import factor_params

    monkeypatch.setattr(q, "STREAM_CODES", 1)
    monkeypatch.setattr(q, "QUANTIZE_CHUNK", 3 * 512)  # row slices of 3: every slice boundary inside the 64 rows
    blocks = k_quant_blocks(rng, 64, 512, type_name)
    qw = import_gguf(blocks, type_name, (64, 512))
    assert type(qw.codes).__name__ == "RowCodes"
    assert _same_bits(qw.dequantize(), dequantize(blocks, gguf.GGMLQuantizationType[type_name]))
    fmt, sg = qw.format, qw.format.groups_per_super

    def exact(weight, factors):
        (a, d), zero = factors
        s = np.repeat(d, sg, axis=1) * a.astype(np.float32)
        assert np.array_equal(s, weight.scales.astype(np.float32))
        if zero is not None:
            z = np.repeat(zero[1], sg, axis=1) * zero[0].astype(np.float32) - np.float32(fmt.offset) * s
            assert np.array_equal(z, weight.zeros.astype(np.float32))
        return True

    assert qw.factors is not None and factor_params(qw) is qw.factors and exact(qw, qw.factors)
    assert exact(qw, factor_params(dataclasses.replace(qw, factors=None)))  # the floats factored: the same values
    order = rng.permutation(64)
    taken = qw.take_rows(order)
    assert exact(taken, taken.factors) and np.array_equal(taken.scales, qw.scales[order])
    stacked = stack_rows([qw, taken])
    assert exact(stacked, stacked.factors)
    with pytest.raises(ValueError, match="factors"):
        dataclasses.replace(qw, factors=((qw.factors[0][0][:3], qw.factors[0][1]), qw.factors[1]))


def test_signed_multipliers_of_a_negative_super_scale_factor_as_the_file_stores_them():
    """llama.cpp writes a Q6_K (Q3_K) block's d negative where its largest weight is, so its int8 multipliers reach
    −128: its float scales still factor to bytes (a negative base), not to float32 parameters. The Q6_K value
    projection of the stored Q4_K_M mix has such blocks."""
    import dataclasses
    import os

    from tmac.quant.kquant import factor_params

    reader = gguf.GGUFReader(os.path.join(os.path.dirname(__file__), "data", "mixes", "Q4_K_M.gguf"))
    t = next(t for t in reader.tensors if t.name == "blk.1.attn_v.weight")
    qw = import_gguf(t.data, "Q6_K", tuple(int(n) for n in reversed(t.shape)))
    (a, d), _ = qw.factors
    assert (d < 0).any() and (a == -128).any()
    (fa, fd), _ = factor_params(dataclasses.replace(qw, factors=None))
    assert np.array_equal(np.repeat(fd, 16, axis=1) * fa.astype(np.float32), qw.scales)


@pytest.mark.parametrize("type_name", ["TQ1_0", "TQ2_0"])
def test_ternary_gguf_blocks_sharing_a_scale_import_per_row(rng, type_name, import_slices):
    """Converted BitNet models repeat one scale in every block: such rows get one scale (and the triple layout)."""
    qtype = gguf.GGMLQuantizationType[type_name]
    tau = rng.integers(-1, 2, (6, 512))
    tau[2, :256] = 0  # an all-zero block: its own scale is 0 and must not matter
    blocks = quantize((tau * np.float32(0.0200042724609375)).astype(np.float32), qtype)
    qw = import_gguf(blocks, type_name, tau.shape)
    assert (qw.format.name, qw.format.group_size, qw.scales.shape) == (f"{type_name.lower()}_rows", "row", (6, 1))
    assert _same_bits(qw.dequantize(), dequantize(blocks, qtype))
    mixed = quantize(rng.standard_normal((6, 512)).astype(np.float32), qtype)  # per-block scales differ
    assert import_gguf(mixed, type_name, (6, 512)).format.group_size == 256
    # the last row's second block alone has another scale (in the last slice, when sliced)
    last = np.concatenate([quantize((tau[:5] * np.float32(0.02)).astype(np.float32), qtype),
                           quantize((tau[5:] * np.float32([0.02] * 256 + [0.03] * 256)).astype(np.float32), qtype)])
    qw = import_gguf(last, type_name, tau.shape)
    assert qw.format.group_size == 256 and _same_bits(qw.dequantize(), dequantize(last, qtype))


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a clear ValueError, not numpy's warnings beside it
def test_gguf_import_rejects_bad_blocks():
    with pytest.raises(ValueError, match="needs 36 bytes"):
        import_gguf(b"\0" * 35, "Q4_0", (1, 64))
    with pytest.raises(ValueError, match="no exact importer for GGUF type MXFP4"):
        import_gguf(b"", "MXFP4", (1, 32))
    with pytest.raises(ValueError, match="IQ2_XS row length 32 is not a multiple of its block size 256"):
        import_gguf(b"", "IQ2_XS", (1, 32))
    nan_block = np.frombuffer(np.float16(np.nan).tobytes() + b"\0" * 16, np.uint8)
    with pytest.raises(ValueError, match="NaN/inf"):
        import_gguf(nan_block, "Q4_0", (1, 32))
    for at in (0, 2):  # Q4_K's d, then its dmin: an error, not an inexact import taken another way
        q4_k = bytearray(144)
        q4_k[at:at + 2] = np.float16(np.inf).tobytes()
        with pytest.raises(ValueError, match="NaN/inf") as e:
            import_gguf(bytes(q4_k), "Q4_K", (1, 256))
        assert not isinstance(e.value, InexactImport)


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([1, 2, 3, 4]), group=st.sampled_from([32, 64, 128, 256, "row", "tensor"]),
       sym=st.booleans(), m=st.integers(1, 9), kg=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_round_trip_property(bits, group, sym, m, kg, seed):
    if sym and bits == 1:
        return
    k = kg * (group if isinstance(group, int) else 32)
    w = np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)
    qw = quantize_weight(w, bits=bits, group_size=group, symmetric=sym)
    assert qw.shape == (m, k) and qw.codes.dtype == np.uint8
    deq = qw.dequantize()
    # requantizing the dequantized weights reproduces them (the grid is a fixed point), up to float rounding
    again = quantize_weight(deq, bits=bits, group_size=group, symmetric=sym).dequantize()
    np.testing.assert_allclose(again, deq, rtol=1e-4, atol=1e-5 * float(np.abs(deq).max() + 1e-30))


@settings(max_examples=40, deadline=None)
@given(case=st.sampled_from(["k_not_divisible", "bits_high", "bits_low", "three_d", "nan", "inf", "int_dtype",
                             "list", "sym1", "empty", "search_not_bool"]))
def test_bad_input_names_the_argument(case):
    w = np.ones((4, 64), np.float32)
    kwargs = dict(bits=2, group_size=32)
    exc, match = ValueError, None
    if case == "k_not_divisible":
        w, match = np.ones((4, 48), np.float32), "group_size"
    elif case == "bits_high":
        kwargs["bits"], match = 7, "bits"
    elif case == "bits_low":
        kwargs["bits"], match = 0, "bits"
    elif case == "three_d":
        w, match = np.ones((2, 2, 64), np.float32), "2-D"
    elif case == "nan":
        w[1, 3], match = np.nan, "NaN"
    elif case == "inf":
        w[0, 0], match = np.inf, "inf"
    elif case == "int_dtype":
        w, exc, match = np.ones((4, 64), np.int32), TypeError, "floating-point"
    elif case == "list":
        w, exc, match = [[1.0] * 64], TypeError, "numpy array or torch tensor"
    elif case == "sym1":
        kwargs.update(bits=1, symmetric=True)
        match = "symmetric"
    elif case == "empty":
        w, match = np.ones((0, 64), np.float32), "empty"
    elif case == "search_not_bool":
        kwargs["search"], exc, match = "no", TypeError, "search"
    with pytest.raises(exc, match=match):
        quantize_weight(w, **kwargs)
