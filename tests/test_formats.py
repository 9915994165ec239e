import numpy as np
import pytest

from tmac import FORMATS, QuantizedWeight, WeightFormat
from tmac.base.formats import GGUF_EXACT

pytestmark = pytest.mark.unit  # needs no compiler (make unit)


def test_gguf_formats_described_once():
    assert set(GGUF_EXACT) == {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "TQ1_0",
                               "TQ2_0", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S",
                               "IQ1_M"}
    assert FORMATS["iq4_xs"].codebook == FORMATS["iq4_nl"].codebook and FORMATS["iq4_xs"].groups_per_super == 8
    # the grid i-quants' levels: sign × llama.cpp's grid magnitudes (IQ1: 8·{−1, 0, 1} ± 1), padded to 16 for IQ1, IQ2
    assert set(FORMATS["iq2_xxs"].codebook) >= {s * v for s in (-1, 1) for v in (0x08, 0x19, 0x2B)}
    assert sorted(FORMATS["iq3_s"].codebook) == list(range(-15, 16, 2))  # (ordered magnitude | sign << 3)
    assert set(FORMATS["iq1_m"].codebook) >= {-9, -7, -1, 1, 7, 9}
    iq1_s = FORMATS["iq1_s"]  # a K-quant of 2-bit codes grid + 1, its ±⅛ shift a group's zero
    assert (iq1_s.bits, iq1_s.has_zeros, iq1_s.codebook, iq1_s.groups_per_super) == (2, True, None, 8)
    assert FORMATS["iq2_xs"].group_size == FORMATS["iq1_m"].group_size == 16 and FORMATS["iq3_xxs"].group_size == 32
    assert FORMATS["q4_1"].has_zeros and not FORMATS["q4_0"].has_zeros
    assert FORMATS["q4_k"].group_size == 32 and FORMATS["q4_k"].gguf.block_size == 256  # 8 groups a block
    assert FORMATS["q6_k"].group_size == 16 and FORMATS["q6_k"].groups_per_super == 16 and not FORMATS["q6_k"].has_zeros
    assert FORMATS["tq2_0"].ternary and FORMATS["tq2_0"].group_size == 256
    assert FORMATS["bitnet"].group_size == "tensor"


def test_gguf_rows_match_the_gguf_package_and_have_their_decoders():
    """Each exact GGUF row's block geometry is llama.cpp's (``gguf.constants.GGML_QUANT_SIZES``), its group size divides
    the block, and its decoder (found from the row) turns a block of the type into the row's shapes."""
    import gguf

    for name, fmt in GGUF_EXACT.items():
        block, size = gguf.constants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
        assert (fmt.gguf.block_size, fmt.gguf.type_size) == (block, size), name
        assert block % fmt.group_size == 0 and (fmt.super_group or block) == block, name
        raw = np.random.default_rng(0).integers(0, 256, (3, size), dtype=np.uint8)
        codes, scales, zeros = fmt.gguf.decoder()(raw, fmt.offset)
        assert codes.shape == (3, block) and scales.size == 3 * block // fmt.group_size, name
        assert (zeros is not None) == fmt.has_zeros, name


def test_convention_w_equals_s_times_q_minus_offset_minus_z():
    fmt = WeightFormat.rtn(3, 32, symmetric=False)
    codes = np.arange(8, dtype=np.uint8).repeat(4).reshape(1, 32)
    s, z = np.array([[0.5]], np.float32), np.array([[0.25]], np.float32)
    w = QuantizedWeight(codes, s, z, fmt).dequantize()
    np.testing.assert_array_equal(w[0], 0.5 * (codes[0].astype(np.float32) - 4) - 0.25)


@pytest.mark.parametrize("bad, exc", [
    (dict(bits=7), ValueError), (dict(bits=0), ValueError), (dict(bits=2.0), TypeError),
    (dict(group_size=48), ValueError), (dict(group_size="col"), ValueError), (dict(group_size=None), TypeError),
])
def test_bad_format_arguments(bad, exc):
    args = dict(bits=2, group_size=128, symmetric=False) | bad
    with pytest.raises(exc, match="bits" if "bits" in bad else "group_size"):
        WeightFormat.rtn(**args)


def test_quantized_weight_validates():
    fmt = WeightFormat.rtn(2, 32, symmetric=True)
    codes = np.zeros((2, 64), np.uint8)
    with pytest.raises(ValueError, match="scales must have shape"):
        QuantizedWeight(codes, np.ones((2, 1), np.float32), None, fmt)
    with pytest.raises(ValueError, match=r"codes .* must lie in \[0, 3\]"):
        QuantizedWeight(codes + 4, np.ones((2, 2), np.float32), None, fmt)
    with pytest.raises(ValueError, match="NaN or inf"):
        QuantizedWeight(codes, np.full((2, 2), np.nan, np.float32), None, fmt)
    with pytest.raises(ValueError, match="has no zeros"):
        QuantizedWeight(codes, np.ones((2, 2), np.float32), np.ones((2, 2), np.float32), fmt)
    with pytest.raises(TypeError, match="uint8"):
        QuantizedWeight(codes.astype(np.int32), np.ones((2, 2), np.float32), None, fmt)
    with pytest.raises(ValueError, match="not divisible by group_size"):
        QuantizedWeight(np.zeros((2, 48), np.uint8), np.ones((2, 1), np.float32), None, fmt)


def test_a_codebook_is_checked_and_read_back():
    """A codebook format's levels: 2^bits distinct integers in int8's range, no zeros, no ternary codes; a format read
    from a file with levels of its own is validated like any other."""
    levels = tuple(range(-8, 8))
    fmt = WeightFormat("cb4", 4, 32, has_zeros=False, codebook=levels)
    codes = np.arange(16, dtype=np.uint8).repeat(2).reshape(1, 32)
    w = QuantizedWeight(codes, np.array([[0.5]], np.float32), None, fmt).dequantize()
    np.testing.assert_array_equal(w[0], 0.5 * np.repeat(np.arange(-8, 8), 2))
    assert WeightFormat.from_dict(fmt.to_dict()) == fmt
    for bad in (levels[:15], levels[:15] + (0,), levels[:15] + (200,), levels[:15] + (1.5,)):
        with pytest.raises(ValueError, match="codebook"):
            WeightFormat("cb4", 4, 32, has_zeros=False, codebook=bad)
    with pytest.raises(ValueError, match="without zeros"):
        WeightFormat("cb4", 4, 32, has_zeros=True, codebook=levels)
    with pytest.raises(ValueError, match="codebook"):
        WeightFormat.from_dict({**fmt.to_dict(), "codebook": [1] * 16})
    with pytest.raises(ValueError, match="malformed"):
        WeightFormat.from_dict({**fmt.to_dict(), "codebook": "levels"})
