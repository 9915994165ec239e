"""tmac.Embedding: quantized token tables, dequantized row by row."""
import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from torch import nn

import tmac
from conftest import smollm2_path
from tmac import QuantizedWeight, WeightFormat, import_gguf, quantize_weight


@pytest.mark.parametrize("bits, group, symmetric", [(1, 32, False), (2, 64, False), (3, "row", False),
                                                    (4, 32, True), (8, 32, True), (4, "tensor", True)])
def test_rows_are_the_dequantized_table(rng, bits, group, symmetric):
    w = rng.standard_normal((50, 128)).astype(np.float32)
    qw = quantize_weight(w, bits=bits, group_size=group, symmetric=symmetric)
    emb = tmac.Embedding(qw)
    ids = torch.tensor([[3, 0, 49], [7, 7, 12]])
    want = qw.dequantize()[ids.numpy()]  # float64 evaluation, rounded once
    got = emb(ids)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 128)
    # (q − offset)·s rounds once in float32; subtracting a zero may round a second time: one ulp at most
    np.testing.assert_allclose(got.numpy(), want, rtol=0 if symmetric else 2.0 ** -23, atol=0 if symmetric else 1e-6)
    table = emb(torch.arange(50))
    assert all(torch.equal(emb.row(i), table[i]) for i in range(50))  # one row at a time
    np.testing.assert_array_equal(emb.quantized_weight().codes, qw.codes)
    expected_bytes = 50 * 128 * {1: 1, 2: 2, 3: 4, 4: 4, 8: 8}[bits] // 8
    assert emb.codes.numel() == expected_bytes


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q8_0"])
def test_k_quant_tables_are_gguf_rows(rng, type_name):
    """llama.cpp's mixes (Q4_K_M and the like) store the token table as Q6_K or another K-quant: its rows, looked up
    from the exact import, are the GGUF spec's dequantized rows (the gguf package's reference)."""
    from tmac.models.files.synthetic import k_quant_blocks

    shape = (40, 256)
    if type_name.endswith("_K"):
        blocks = k_quant_blocks(rng, *shape, type_name)
    else:
        blocks = gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32),
                                      gguf.GGMLQuantizationType[type_name])
    emb = tmac.Embedding(import_gguf(blocks, type_name, shape))
    want = dequantize(blocks, gguf.GGMLQuantizationType[type_name]).reshape(shape)
    got = emb(torch.arange(shape[0])).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("type_name", ["Q2_K", "Q4_K", "Q6_K", "IQ1_S", "IQ4_XS", "Q4_0"])
def test_a_streamed_table_reads_its_parameters_from_the_file_too(rng, monkeypatch, type_name):
    """A token table left in the GGUF (``StreamedEmbedding``) holds neither codes nor, where its format is the
    file's type, scales and zeros (a K-quant table's float32 parameters were 2-4 bits a weight): a lookup decodes its
    rows' blocks whole. Its rows are those it gave with the parameters held, bit for bit; its state dict, ``held()``
    and ``quantized_weight()`` still have every parameter."""
    import tmac.quant.quantize as q
    from tmac.models.files.synthetic import k_quant_blocks
    from tmac.quant.embedding import StreamedEmbedding

    monkeypatch.setattr(q, "STREAM_CODES", 1)
    shape = (48, 512)
    blocks = gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32) * 0.02,
                                  gguf.GGMLQuantizationType.Q4_0) if type_name == "Q4_0" else \
        k_quant_blocks(rng, *shape, type_name)
    qw = import_gguf(blocks, type_name, shape)
    emb = StreamedEmbedding(qw)
    assert not dict(emb.named_buffers())  # nothing held: codes, scales and zeros stay in the file
    ids = torch.tensor([0, 5, 47, 5, 30])
    got = emb(ids)
    with_params = tmac.Embedding(qw)
    assert torch.equal(got, with_params(ids)) and torch.equal(emb.row(47), with_params.row(47))
    want = dequantize(blocks, gguf.GGMLQuantizationType[type_name]).reshape(shape)[ids.numpy()]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    assert torch.equal(emb.scales, with_params.scales) and (emb.zeros is None) == (with_params.zeros is None)
    assert emb.zeros is None or torch.equal(emb.zeros, with_params.zeros)
    state = emb.state_dict()
    plain = tmac.Embedding._empty(state["_extra_state"])
    plain.load_state_dict(state)
    assert torch.equal(plain(ids), got) and torch.equal(emb.held()(ids), got)
    np.testing.assert_array_equal(emb.quantized_weight().dequantize(), with_params.quantized_weight().dequantize())


def test_smollm2_q8_0_table_is_bit_exact():
    reader = gguf.GGUFReader(smollm2_path())
    (t,) = [t for t in reader.tensors if t.name == "token_embd.weight"]
    assert t.tensor_type.name == "Q8_0"
    shape = tuple(int(d) for d in reversed(t.shape))
    emb = tmac.Embedding(import_gguf(t.data, "Q8_0", shape))
    ids = torch.tensor([0, 1, 2, 1000, 49151])
    want = dequantize(t.data, t.tensor_type).reshape(shape)[ids.numpy()]
    assert np.array_equal(emb(ids).numpy().view(np.uint32), want.astype(np.float32).view(np.uint32))
    assert all(torch.equal(emb.row(int(i)), emb(i)) for i in ids)
    assert emb.codes.numel() + emb.scales.numel() * 2 == shape[0] * shape[1] * 34 // 32  # Q8_0's own size


def test_a_gguf_table_stays_in_the_file_and_gives_its_rows():
    """Loading SmolLM2's GGUF leaves its tied Q8_0 table in the file (``StreamedEmbedding``: rows decoded from the
    mapped blocks on lookup; the head holds the packed weights): its rows are the gguf package's dequantized rows,
    bit for bit; a state dict holds the codes, and a plain ``tmac.Embedding`` loaded from it gives the same rows."""
    from tmac.quant.embedding import StreamedEmbedding

    model = tmac.load_model(smollm2_path(), context=8, progress=False)
    emb = model.tok_embeddings
    assert isinstance(emb, StreamedEmbedding) and "codes" not in dict(emb.named_buffers())
    reader = gguf.GGUFReader(smollm2_path())
    (t,) = [t for t in reader.tensors if t.name == "token_embd.weight"]
    shape = tuple(int(d) for d in reversed(t.shape))
    ids = torch.tensor([0, 1, 2, 1000, 49151, 1000])
    want = dequantize(t.data, t.tensor_type).reshape(shape)[ids.numpy()]
    assert np.array_equal(emb(ids).numpy().view(np.uint32), want.astype(np.float32).view(np.uint32))
    assert torch.equal(emb.row(1000), emb(ids)[3]) and emb(ids[:0]).shape == (0, shape[1])
    state = emb.state_dict()
    plain = tmac.Embedding._empty(state["_extra_state"])
    plain.load_state_dict(state)
    assert torch.equal(plain(ids), emb(ids))
    with pytest.raises(TypeError, match="RowCodes"):
        StreamedEmbedding(import_gguf(np.asarray(t.data).reshape(-1)[:34], "Q8_0", (1, 32)))
    # the decode plan reads a row from the file's blocks in compiled code (the glue's embed for Q8_0): the same row
    from tmac.models.run.decode import DecodePlan

    plan = DecodePlan.build(model)
    assert plan is not None and plan._keep[0].spec.embed_blocks == "Q8_0"
    x = plan.buf["x"][0]
    for token in (0, 1000, 49151):
        plan.embed_into(token)
        assert torch.equal(x, emb.row(token)), token
    with pytest.raises(ValueError, match="outside the table"):
        plan.embed_into(49152)


def test_bad_ids_raise(rng):
    emb = tmac.Embedding(quantize_weight(rng.standard_normal((10, 32)).astype(np.float32), bits=4, group_size=32))
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        emb(torch.tensor([3, 10]))
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        emb(torch.tensor([-1]))
    with pytest.raises(TypeError, match="integer"):
        emb(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="whole bytes"):
        tmac.Embedding(QuantizedWeight(np.zeros((2, 4), np.uint8), np.ones((2, 1), np.float32), None,
                       WeightFormat("w1row", 1, "row", has_zeros=False)))


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(40, 64)


def test_save_and_load(rng, tmp_path):
    qw = quantize_weight(rng.standard_normal((40, 64)).astype(np.float32), bits=3, group_size=32)
    model = _Tiny()
    model.tok = tmac.Embedding(qw)
    tmac.save(model, tmp_path / "m.tmac")
    with torch.device("meta"):
        empty = _Tiny()
    loaded = tmac.load(tmp_path / "m.tmac", empty)
    assert isinstance(loaded.tok, tmac.Embedding) and loaded.tok.format == qw.format
    ids = torch.arange(40)
    assert torch.equal(loaded.tok(ids), model.tok(ids))
    # a file whose codes break the format's range is refused, not used
    state = model.state_dict()
    state["tok.codes"] = torch.full_like(state["tok.codes"], 0xFF)  # 3-bit codes in nibbles: 15 > 7
    with torch.device("meta"):
        empty = _Tiny()
    empty.tok = tmac.Embedding._empty(state["tok._extra_state"])
    with pytest.raises(RuntimeError, match="codes of format"):
        empty.load_state_dict(state, assign=True)


def test_float_tables_keep_the_narrowest_exact_dtype(rng):
    """A float table read from a 16-bit file keeps 16 bits (half the memory of float32) and the very same rows."""
    from tmac.models.files.load import token_embedding

    base = torch.from_numpy(rng.standard_normal((64, 32)).astype(np.float32))
    # bfloat16 values of this size fit float16 too; ones beyond float16's range keep bfloat16
    for source, scale, kept in [(torch.float16, 1, torch.float16), (torch.bfloat16, 1e6, torch.bfloat16),
                                (torch.float32, 1, torch.float32)]:
        table = (base * scale).to(source).float()
        emb = token_embedding(table, requantized=False)
        assert emb.weight.dtype == kept, source
        assert torch.equal(emb(torch.arange(64)).float(), table)
    for source in (torch.float16, torch.bfloat16):  # as a 16-bit file gives it: kept as it is, not copied
        table = base.to(source)
        emb = token_embedding(table, requantized=False)
        assert emb.weight.dtype == source and emb.weight.data_ptr() == table.data_ptr()
        assert torch.equal(emb(torch.arange(64)), table)
