"""The LUT reference against plain fp64 matmul and against a from-scratch check of each step."""
import numpy as np
import pytest

from conftest import rel_l2
from tmac import quantize_weight
from tmac.base import reference as ref

pytestmark = pytest.mark.unit  # needs no compiler (make unit)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("group", [32, 128, "row"])
def test_lut_matmul_close_to_fp64_at_k4096(rng, bits, group):
    x = rng.standard_normal((2, 4096)).astype(np.float32)
    w = rng.standard_normal((128, 4096)).astype(np.float32)
    qw = quantize_weight(w, bits=bits, group_size=group)
    exact = x.astype(np.float64) @ qw.dequantize().astype(np.float64).T
    assert rel_l2(ref.lut_matmul(x, qw), exact) <= 0.015


def test_ternary_lut_matmul(rng):
    x = rng.standard_normal((1, 4096)).astype(np.float32)
    qw = quantize_weight(rng.standard_normal((64, 4096)).astype(np.float32), ternary=True, group_size="tensor")
    exact = x.astype(np.float64) @ qw.dequantize().astype(np.float64).T
    assert rel_l2(ref.lut_matmul(x, qw), exact) <= 0.015


def test_bit_plane_identity(rng):
    # q − 2^(b−1) = Σ_i 2^(i−1)·σ_i − ½ with σ_i = 2·bit_i − 1
    for bits in (1, 2, 3, 4):
        q = np.arange(1 << bits)
        planes = ref.bit_planes(q.astype(np.uint8).reshape(1, -1), bits)[:, 0].astype(np.float64)
        rhs = sum(2.0 ** (i - 1) * (2 * planes[i] - 1) for i in range(bits)) - 0.5
        np.testing.assert_array_equal(q - 2 ** (bits - 1), rhs)


def test_tables_hold_every_signed_partial_sum(rng):
    x = rng.standard_normal((1, 8)).astype(np.float32)
    tables = ref.build_tables(x)
    for t in range(2):
        for p in range(16):
            expected = sum((((p >> j) & 1) - 0.5) * float(x[0, 4 * t + j]) for j in range(4))
            assert abs(tables[0, t, p] - expected) < 1e-6


def test_integer_part_equals_direct_sum(rng):
    x = rng.standard_normal((1, 64)).astype(np.float32)
    codes = rng.integers(0, 8, (3, 64)).astype(np.uint8)
    qt, _ = ref.quantize_tables(ref.build_tables(x), 32)
    r = ref.lut_accumulate(qt, codes, 3, 32)
    for m in range(3):
        for g in range(2):
            direct = 0
            for t in range(8 * g, 8 * g + 8):
                for i in range(3):
                    idx = sum((((int(codes[m, 4 * t + j]) >> i) & 1) << j) for j in range(4))
                    direct += (1 << i) * int(qt[0, t, idx])
            assert r[0, m, g] == direct


def test_table_quantization_uses_full_int8_range(rng):
    qt, ls = ref.quantize_tables(ref.build_tables(rng.standard_normal((3, 256)).astype(np.float32)), 64)
    assert np.abs(qt.astype(np.int32)).reshape(3, 4, -1).max(axis=2).min() == 127
    assert (ls > 0).all()
    qz, lz = ref.quantize_tables(ref.build_tables(np.zeros((1, 64), np.float32)), 32)
    assert not qz.any() and not lz.any()


@pytest.mark.parametrize("k", [4096, 3200, 576])
def test_triple_lut_matmul_close_to_fp64(rng, k):
    x = rng.standard_normal((2, k)).astype(np.float32)
    qw = quantize_weight(rng.standard_normal((64, k)).astype(np.float32), ternary=True, group_size="row")
    exact = x.astype(np.float64) @ qw.dequantize().astype(np.float64).T
    assert rel_l2(ref.lut_matmul_triples(x, qw), exact) <= 0.015


def test_triple_indices_and_tables_from_scratch(rng):
    """Each triple of ternary weights is (index, negation) with ±T[index] = Σ τ·x, checked for all 27 patterns."""
    tau = np.array([[a, b, c] for a in (-1, 0, 1) for b in (-1, 0, 1) for c in (-1, 0, 1)])  # [27, 3]
    codes = (tau.reshape(1, -1) + 2).astype(np.uint8)  # one row, 81 weights
    k = codes.shape[1]
    kp = ref.padded_k(k)
    x = rng.standard_normal((1, k)).astype(np.float32)
    idx, neg = ref.triple_indices(codes, kp)
    tables = ref.build_triple_tables(x, kp)
    assert kp == 192 and idx.shape == (1, 64) and idx.max() <= 13
    for t in range(27):
        direct = float(np.dot(tau[t], x[0, 3 * t:3 * t + 3].astype(np.float64)))
        got = (-1 if neg[0, t] else 1) * float(tables[0, t, idx[0, t]])
        assert abs(got - direct) < 1e-5
    assert not neg[0, 27:].any() and (idx[0, 27:] == 13).all()  # padding: τ = 0, entry 13 = 0
    assert not tables[0, :, 14:].any() and not tables[0, 27:].any()
