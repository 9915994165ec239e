"""The weight layouts (``tmac.quant.layout``) against their documented byte formulas, read back byte by byte from the
codes, on every vector width, and their unpackers against their packers. numpy only: no kernel is compiled."""
import itertools

import numpy as np
import pytest

from tmac.base import reference as ref
from tmac.quant.choose import tiled
from tmac.kernels import ISAS
from tmac.quant.layout import Planes, Quads, Triples

pytestmark = pytest.mark.unit  # needs no compiler (make unit)

WIDTHS = {16: "neon", 32: "avx2", 64: "avx512_vbmi"}


def _spec(vl: int, bits: int, triples=False, quads=False, k=384):
    isa = ISAS[WIDTHS[vl]]
    fixed = (2, k, k, ref.TRIPLE_LUT_GROUP, False) if triples else (bits, k, 32, 32, True)
    return tiled(isa, fixed, {"triples": triples, "quads": quads}, {})


def _codes(rng, spec, blocks=2):
    low, high = (1, 4) if spec.triples else (0, 1 << spec.bits)  # ternary codes are 1..3
    return rng.integers(low, high, (blocks * spec.block_rows, spec.k), dtype=np.uint8)


def _plane_index(codes, row, plane, t):  # bit j: bit ``plane`` of code 4t + j of ``row``
    return sum(((int(codes[row, 4 * t + j]) >> plane) & 1) << j for j in range(4))


CASES = [(vl, bits, False, False) for vl in WIDTHS for bits in (1, 2, 3, 4, 5, 6, 8)] + \
    [(vl, 2, True, False) for vl in WIDTHS] + [(64, bits, False, True) for bits in (1, 2, 3, 5)] + [(64, 2, True, True)]


@pytest.mark.parametrize("vl, bits, triples, quads", CASES)
def test_every_byte_is_where_the_layout_says_and_unpacking_inverts_packing(rng, vl, bits, triples, quads):
    spec = _spec(vl, bits, triples, quads)
    layout = spec.layout
    assert type(layout) is (Quads if quads else Triples if triples else Planes)
    codes = _codes(rng, spec)
    w = layout.pack(codes, spec)
    bm = spec.block_rows
    assert w.shape == layout.weight_shape(2, spec.k, bm)
    np.testing.assert_array_equal(layout.unpack(w, spec), codes)
    idx, neg = ref.triple_indices(codes, spec.k_padded) if triples else (None, None)

    def index(row, plane, t):
        return int(idx[row, t]) if triples else _plane_index(codes, row, plane, t)

    picks = zip(rng.integers(0, 2, 40), rng.integers(0, w.shape[1], 40), rng.integers(0, w.shape[2], 40))
    for blk, step, byte in picks:
        got = int(w[blk, step, byte])
        if quads:
            tables = layout.step_tables
            chunk, at = divmod(int(byte), 4 * bm)
            if chunk < len(layout.quad_chunks):  # byte 4i + p of vector v: row v·VL/4 + i, plane o + p mod P
                first, planes, t0 = layout.quad_chunks[chunk]
                v, lane = divmod(at, vl)
                i, p = divmod(lane, 4)
                row, plane = blk * bm + v * vl // 4 + i, first + p % planes
                lo, hi = tables * step + t0 + p // planes, tables * step + t0 + 4 // planes + p // planes
                assert got == index(row, plane, lo) | index(row, plane, hi) << 4
            else:  # mask h of vector v at 4·BM + v·VL/4 + h·VL/8: bit 4i + p negates table 8·step + 4h + p
                v, rest = divmod(at, vl // 4)
                h, b = divmod(rest, vl // 8)
                for bit in range(8):
                    i, p = divmod(8 * b + bit, 4)
                    assert (got >> bit & 1) == neg[blk * bm + v * vl // 4 + i, 8 * step + 4 * h + p]
        elif triples:
            j, r = divmod(int(byte), bm)
            if j < 4:  # table pair j: low nibble triple 8·step + 2j, high 8·step + 2j + 1, of row r
                row = blk * bm + r
                assert got == index(row, 0, 8 * step + 2 * j) | index(row, 0, 8 * step + 2 * j + 1) << 4
            else:  # mask b of vector v at 4·BM + v·VL + b·VL/8: bit l negates triple 8·step + b of row v·VL + l
                v, rest = divmod(r, vl)
                b, octet = divmod(rest, vl // 8)
                for bit in range(8):
                    assert (got >> bit & 1) == neg[blk * bm + v * vl + 8 * octet + bit, 8 * step + b]
        else:  # chunk of planes o .. o+P−1 at BM·o; byte l of vector v: row v·VL/P + l // P, plane o + l % P
            first, planes = next((o, p) for o, p in layout.chunks if bm * o <= byte < bm * (o + p))
            v, lane = divmod(int(byte) - bm * first, vl)
            row, plane = blk * bm + v * vl // planes + lane // planes, first + lane % planes
            assert got == index(row, plane, 2 * step) | index(row, plane, 2 * step + 1) << 4


def test_a_layout_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="quads need"):
        _spec(64, 4, quads=True)
    with pytest.raises(ValueError, match="quads need"):
        _spec(32, 2, quads=True)
    with pytest.raises(ValueError, match="triples need"):
        tiled(ISAS["avx2"], (2, 384, 32, 32, True), {"triples": True}, {})


def test_a_saved_spec_carries_the_isa_vector_width_and_is_checked_against_it():
    """Files have always held a spec's vector width; it is the ISA's (not a field of its own) and a file whose width
    disagrees with its ISA is refused."""
    import json

    from tmac.quant.spec import KernelSpec

    spec = _spec(64, 3, quads=True)
    saved = json.loads(spec.to_json())
    assert saved["vector_bytes"] == ISAS["avx512_vbmi"].vector_bytes == spec.vector_bytes
    assert KernelSpec.from_dict(saved) == spec
    assert KernelSpec.from_dict({f: v for f, v in saved.items() if f != "vector_bytes"}) == spec
    for width in (32, 0, "64", None):
        with pytest.raises(ValueError, match="vector_bytes"):
            KernelSpec.from_dict({**saved, "vector_bytes": width})


def _grid_spec(k=256, type_name="IQ2_XXS", **tiling):
    from tmac.base.formats import FORMATS
    from tmac.quant.choose import spec_for_format

    return spec_for_format(FORMATS[type_name.lower()], k, ISAS["avx512_vbmi"], **tiling)


@pytest.mark.parametrize("type_name, magnitudes", [("IQ2_XXS", (8, 25, 43)), ("IQ3_XXS", (4, 12, 20, 28, 36, 44, 52, 62)),
                                                   ("IQ2_XS", (8, 25, 43)), ("IQ3_S", tuple(range(1, 16, 2))),
                                                   ("IQ2_S", (8, 25, 43)), ("IQ1_M", (-1, 0, 1)),
                                                   ("IQ1_S", (-1, 0, 1))])
def test_grid_quads_hold_indices_and_a_sign_byte_a_row_a_step(type_name, magnitudes):
    """IQ2_XXS, IQ3_XXS, IQ2_XS, IQ3_S, IQ2_S, IQ1_M and IQ1_S on AVX-512 VBMI (``GridQuads``): a pair of vectors' 32 rows a
    step hold each row's grid indices (IQ2_XXS, IQ2_XS, IQ2_S, IQ1_M one entry of 8 weights, IQ3_XXS, IQ3_S two of 4:
    byte E·i + e) and then its sign byte (at E·32 + i, in ``SIGN_ORDER``; IQ2_XS: its 512-entry grid's ninth index bit
    and 7 signs, the 8th their parity; IQ1_M none), then the higher index bits as masks of 32·E bits (IQ3_S's ninth,
    IQ2_S's ninth and tenth, IQ1_M's 9th-11th: bit E·i + e of mask h is bit 8 + h of index E·i + e; IQ1_M's shifts in
    its multipliers, bit 4 + e of its group's; IQ1_S's too, four entries a group of 32), read back against llama.cpp's grid from the ``gguf`` package; a code
    is magnitude | sign << b (IQ1_M: grid + 1 | shift << 2), levels the codebook's; unpacking inverts packing, and
    codes that are no grid entry, signs of odd parity for IQ2_XS, or two shifts in an IQ1_M entry are refused by
    name."""
    import gguf.quants

    from tmac.quant.layout import SIGN_ORDER, GridQuads

    spec = _grid_spec(type_name=type_name)
    layout = spec.layout
    assert type(layout) is GridQuads and spec.grid == type_name and spec.quads
    cls = getattr(gguf.quants, type_name)
    cls.init_grid()
    grid = np.rint(np.asarray(cls.grid, np.float64).reshape(cls.grid_shape)).astype(int)
    width, entries = grid.shape[1], 8 // grid.shape[1]
    bits = 2 if width == 8 else 3
    rng = np.random.default_rng(0)
    bm, steps = spec.block_rows, spec.k // 8
    idx = rng.integers(0, len(grid), (2 * bm, steps, entries))
    neg = rng.integers(0, 2, (2 * bm, steps, 8))
    nine = len(grid) == 512 and width == 8  # (IQ2_XS)
    shifts = type_name.startswith("IQ1")  # (a shift, −⅛ or +⅛, an entry: its "sign")
    if nine:  # llama.cpp's 8th sign is the parity of the 7 stored
        neg[:, :, 7] = neg[:, :, :7].sum(axis=2) % 2
    if shifts:
        neg[:] = neg[:, :, :1]
    values = grid[idx].reshape(2 * bm, steps, 8)
    codes = (np.searchsorted(magnitudes, values) | (neg << bits)).reshape(2 * bm, -1).astype(np.uint8)
    levels = 8 * values + np.where(neg, -1, 1) if shifts else np.where(neg, -1, 1) * values
    assert (np.asarray(spec.codebook)[codes] == levels.reshape(2 * bm, -1)).all()
    w = layout.pack(codes, spec)
    masks = {256: 0, 512: 0 if nine else 1, 1024: 2, 2048: 3}[len(grid)]
    pair_bytes = (entries + 1 - shifts) * 32 + 4 * entries * masks
    assert w.shape == (2, steps, pair_bytes * bm // 32)
    for blk, step, byte in zip(rng.integers(0, 2, 80), rng.integers(0, steps, 80), rng.integers(0, w.shape[2], 80)):
        pair, at = divmod(int(byte), pair_bytes)
        if at < 32 * entries:
            i, e = divmod(at, entries)
            assert w[blk, step, byte] == idx[blk * bm + 32 * pair + i, step, e] & 255
        elif at >= 32 * (entries + 1 - shifts):  # mask h's byte b: bit j is bit 8 + h of index byte 8·b + j
            h, b = divmod(at - 32 * (entries + 1 - shifts), 4 * entries)
            for j in range(8):
                i, e = divmod(8 * b + j, entries)
                assert (w[blk, step, byte] >> j & 1) == idx[blk * bm + 32 * pair + i, step, e] >> (8 + h) & 1
        else:
            row = blk * bm + 32 * pair + at - 32 * entries
            want = sum(int(neg[row, step, j]) << k for k, j in enumerate(SIGN_ORDER[width]))
            if nine:
                want = idx[row, step, 0] >> 8 | (want & 0x7F) << 1
            assert w[blk, step, byte] == want
    if shifts:  # the shifts are held in the groups' multiplier bytes, bits 4 + e
        held = layout.shift_bits(codes, spec.group_size)
        per = spec.group_size // 8
        want = sum(neg[:, e::per, 0] << (4 + e) for e in range(per))
        np.testing.assert_array_equal(held, want.reshape(held.shape))
        np.testing.assert_array_equal(layout.with_shifts(layout.unpack(w, spec), held, spec.group_size), codes)
    else:
        np.testing.assert_array_equal(layout.unpack(w, spec), codes)
    if shifts:
        codes[5, 16] ^= 1 << bits  # one weight's shift against its entry's
        with pytest.raises(ValueError, match=r"row 5, activations 16-23.*two shifts in one grid entry"):
            layout.pack(codes, spec)
        codes[5, 16] ^= 1 << bits
    if nine:
        codes[5, 16] ^= 1 << bits  # one sign flipped: odd
        with pytest.raises(ValueError, match=r"row 5, activations 16-23.*odd count of negative signs"):
            layout.pack(codes, spec)
        codes[5, 16] ^= 1 << bits
    codes[5, 17] = 1 << (bits + 1)  # a code above magnitude | sign
    with pytest.raises(ValueError, match=rf"row 5, activations 16-23.*{type_name}'s grid"):
        layout.pack(codes, spec)
    present = {tuple(np.searchsorted(magnitudes, entry)) for entry in grid}
    missing = next(m for m in itertools.product(range(len(magnitudes)), repeat=width) if m not in present)
    codes[5, 16:16 + width] = missing  # magnitudes that are no entry of the grid
    with pytest.raises(ValueError, match=rf"row 5, activations 16-23.*{type_name}'s grid"):
        layout.pack(codes, spec)


def test_grid_and_super_exponent_fields_round_trip_and_are_checked():
    """A grid spec's JSON names its grid (and its super scales' exponent); a spec without them is written as before
    they existed; a grid on an ISA that does not expand grids, or an exponent without super groups, is refused."""
    import json

    from tmac.quant.spec import KernelSpec

    spec = _grid_spec(super_exponent=3)
    saved = json.loads(spec.to_json())
    assert (saved["grid"], saved["super_exponent"]) == ("IQ2_XXS", 3)
    assert KernelSpec.from_dict(saved) == spec and spec.name.endswith("_iq2_xxs_se3")
    plain = _spec(64, 3, quads=True)
    assert not {"grid", "super_exponent"} & set(json.loads(plain.to_json()))
    with pytest.raises(ValueError, match="expands grids"):
        KernelSpec.from_dict({**saved, "quads": False})
    with pytest.raises(ValueError, match="super_exponent"):
        KernelSpec.from_dict({**json.loads(plain.to_json()), "super_exponent": 2})
    with pytest.raises(ValueError, match="grid"):
        KernelSpec.from_dict({**saved, "grid": 7})
    with pytest.raises(ValueError, match="not one of"):
        KernelSpec.from_dict({**saved, "grid": "IQ4_XS"})
    with pytest.raises(ValueError, match="takes its own codebook"):
        KernelSpec.from_dict({**saved, "grid": "IQ3_XXS"})
    # IQ2_XS's grid has IQ2_XXS's levels, but not its entries: a weight of one is not packed in the other's grid
    from tmac import QuantizedWeight
    from tmac.base.formats import FORMATS
    from tmac.execution.packing import pack

    other = KernelSpec.from_dict({**saved, "grid": "IQ2_XS"})
    qw = QuantizedWeight(np.zeros((64, spec.k), np.uint8), np.ones((64, spec.k // 32), np.float32), None,
                         FORMATS["iq2_xxs"])
    with pytest.raises(ValueError, match="does not match kernel"):
        pack(qw, other)
