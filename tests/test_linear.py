"""tmac.Linear, quantize_model, save/load — against F.linear on the weight the packed data represents."""
import threading
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tmac
from conftest import rel_l2
from tmac.nn.linear import Linear


def _close(y, ref, bound=0.015):
    err = rel_l2(y.float().numpy(), ref.float().numpy())
    assert err <= bound, err
    return err


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(576, 1536), (200, 320)])
def test_forward_matches_dequantized_weight(bits, shape):
    torch.manual_seed(bits)
    out_f, in_f = shape
    lin = Linear.from_float(nn.Linear(in_f, out_f), bits=bits, group_size=64)
    w = lin.dequantized_weight()
    for lead in [(1,), (7,), (2, 3)]:  # GEMV, GEMM, extra leading dims
        x = torch.randn(*lead, in_f)
        with torch.inference_mode():
            _close(lin(x), F.linear(x, w, lin.bias))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_give_half_outputs(dtype):
    torch.manual_seed(0)
    lin = Linear.from_float(torch.randn(96, 256), bits=4, group_size=32, bias=torch.randn(96))
    x = torch.randn(4, 256).to(dtype)
    with torch.no_grad():
        y = lin(x)
    assert y.dtype == dtype and y.shape == (4, 96)
    _close(y, F.linear(x.float(), lin.dequantized_weight(), lin.bias), bound=0.02)


def test_ternary_and_symmetric_layers():
    torch.manual_seed(1)
    w = torch.randn(128, 512)
    x = torch.randn(3, 512)
    for lin in (Linear.from_float(w, ternary=True, group_size="tensor"), Linear.from_float(w, bits=4, symmetric=True)):
        with torch.no_grad():
            _close(lin(x), F.linear(x, lin.dequantized_weight()))


def test_dequantized_weight_is_the_quantized_weight():
    rng = np.random.default_rng(0)
    qw = tmac.quantize_weight(rng.standard_normal((70, 256)).astype(np.float32), bits=3, group_size=128)
    lin = Linear.from_quantized(qw)
    np.testing.assert_array_equal(lin.dequantized_weight().numpy(), qw.dequantize())
    assert lin.in_features == 256 and lin.out_features == 70 and lin.bias is None


def test_constructor_is_usable_like_nn_linear():
    torch.manual_seed(0)
    lin = Linear(256, 64, bias=True, bits=2, group_size=128)
    text = repr(lin)
    assert "bits=2" in text and "group_size=128" in text and f"isa={lin.spec.isa}" in text
    with torch.no_grad():
        y = lin(torch.randn(2, 256))
    assert y.shape == (2, 64) and torch.isfinite(y).all()


def test_grad_mode_rules():
    lin = Linear(64, 32, bits=2, group_size=32)
    x = torch.randn(2, 64, requires_grad=True)
    with pytest.raises(RuntimeError, match="inference-only"):
        lin(x)
    with torch.no_grad():
        assert lin(x).shape == (2, 32)
    assert lin(torch.randn(2, 64)).shape == (2, 32)  # no grad needed: fine in grad mode too


def test_misuse():
    lin = Linear(64, 32, bits=2, group_size=32)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
            lin(torch.randn(2, 63))
        with pytest.raises(TypeError, match="int64"):
            lin(torch.ones(2, 64, dtype=torch.int64))
        with pytest.raises(TypeError, match="torch.Tensor"):
            lin(np.ones((2, 64), np.float32))
        empty = lin(torch.randn(0, 64))
        assert empty.shape == (0, 32)
        assert lin(torch.randn(3, 0, 64)).shape == (3, 0, 32)
        base = torch.randn(64, 6)
        strided = base.t()  # non-contiguous [6, 64]
        np.testing.assert_allclose(lin(strided).numpy(), lin(strided.contiguous()).numpy(), rtol=0, atol=0)
        # packed tensors are validated once and remembered: another tensor, or the same one resized in place,
        # is validated again before any kernel reads it
        x = torch.randn(1, 64)
        y = lin(x)
        good = lin.qweight
        lin.qweight = good[:, :-1].clone()
        with pytest.raises(ValueError, match="packed weights"):
            lin(x)
        lin.qweight = good
        np.testing.assert_array_equal(lin(x).numpy(), y.numpy())
        good.resize_(good.shape[0] - 1, *good.shape[1:])
        with pytest.raises(ValueError, match="packed weights"):
            lin(x)
    with pytest.raises(ValueError, match="bits"):
        Linear(64, 32, bits=7)
    with pytest.raises(ValueError, match="group_size"):
        Linear(64, 32, group_size=48)


def test_dtype_moves_keep_packed_tensors():
    lin = Linear(64, 32, bits=4, group_size=32)
    x = torch.randn(2, 64)
    with torch.no_grad():
        before = lin(x)
        lin.to(torch.bfloat16)
        assert lin.scales.dtype == torch.float16 and lin.qweight.dtype == torch.uint8  # as packed
        assert torch.equal(lin(x), before)


def test_threads_and_concurrent_callers():
    torch.manual_seed(0)
    lin = Linear.from_float(torch.randn(512, 1024), bits=2, group_size=128)
    xs = [torch.randn(n, 1024) for n in (1, 5, 1, 9, 2, 1, 3, 4)]
    with torch.no_grad():
        serial = [lin(x) for x in xs]
        tmac.set_num_threads(1)
        try:
            assert all(torch.equal(lin(x), y) for x, y in zip(xs, serial))
        finally:
            tmac.set_num_threads(2)
        results = [[None] * len(xs) for _ in range(4)]

        def worker(t):
            for _ in range(5):
                for i, x in enumerate(xs):
                    results[t][i] = lin(x)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r, serial))


def test_torch_compile_and_export_trace_the_custom_op():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.SiLU(), nn.Linear(512, 128))
    tmac.quantize_model(model, bits=2, group_size=128)
    x = torch.randn(3, 256)
    with torch.no_grad():
        ref = model(x)
        compiled = torch.compile(model, fullgraph=True)  # fullgraph: any graph break is an error
        torch.testing.assert_close(compiled(x), ref)
        exported = torch.export.export(model, (x,))
    assert "tmac.lut_linear" in exported.graph_module.code
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(x), ref)


def test_state_dict_round_trip_and_repacking(monkeypatch):
    torch.manual_seed(0)
    src = Linear.from_float(nn.Linear(256, 100), bits=3, group_size=64)
    x = torch.randn(2, 256)
    with torch.no_grad():
        ref = src(x)
    sd = src.state_dict()
    same = Linear(256, 100, bits=3, group_size=64)
    monkeypatch.setattr("tmac.nn.linear.pack", lambda *a, **k: pytest.fail("repacked although the spec matches"))
    same.load_state_dict(sd)
    monkeypatch.undo()
    with torch.no_grad():
        assert torch.equal(same(x), ref)
    # packed for another tiling: repacked into this layer's layout, same numbers
    other = Linear.from_quantized(src.quantized_weight(), src.bias, block_rows=2 * src.spec.block_rows)
    target = Linear(256, 100, bits=3, group_size=64)
    target.load_state_dict(other.state_dict())
    assert target.spec == src.spec
    with torch.no_grad():
        torch.testing.assert_close(target(x), ref)
    with pytest.raises(RuntimeError, match="w3g64"):
        Linear(256, 100, bits=2, group_size=64).load_state_dict(sd)
    bad = dict(sd)
    bad["scales"] = bad["scales"][:, :, :-1]
    with pytest.raises(RuntimeError, match="scales"):
        Linear(256, 100, bits=3, group_size=64).load_state_dict(bad)


@pytest.mark.parametrize("bits", [1, 2])
def test_state_packed_for_a_foreign_isa_is_repacked(bits):
    """A checkpoint packed on an arm64 (NEON, 16-byte vectors) machine loads here (1 bit: into quads where this CPU
    has VBMI)."""
    torch.manual_seed(0)
    qw = tmac.quantize_weight(torch.randn(96, 256), bits=bits, group_size=128)
    arm = Linear.from_quantized(qw, isa="neon")
    local = Linear.from_quantized(qw)
    local_fresh = Linear(256, 96, bias=False, bits=bits, group_size=128)
    local_fresh.load_state_dict(arm.state_dict())
    x = torch.randn(3, 256)
    with torch.no_grad():
        assert torch.equal(local_fresh(x), local(x))
        with pytest.raises(tmac.KernelUnavailableError, match="neon"):
            arm(x)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_k_quant_state_round_trip(tmp_path, type_name):
    """A Q4_K layer's byte multipliers and super scales (Q6_K: signed ones) survive tmac.save/tmac.load, also
    packed for NEON (repacked here); a state with plain float32 parameters (an older tmac's) loads as such."""
    from tmac.models.files.synthetic import k_quant_blocks
    from tmac.quant.quantize import import_gguf

    qw = import_gguf(k_quant_blocks(np.random.default_rng(0), 96, 512, type_name), type_name, (96, 512))
    local, plain = Linear.from_quantized(qw), Linear.from_quantized(qw, super_groups=0)
    assert local.spec.super_groups == 256 // qw.format.group_size and plain.spec.super_groups == 0
    assert local.scales.dtype == (torch.uint8 if qw.format.has_zeros else torch.int8)
    x = torch.randn(3, 512)
    for src, want in ((local, local), (Linear.from_quantized(qw, isa="neon"), local), (plain, plain)):
        tmac.save(nn.Sequential(src), tmp_path / "q4k.safetensors")
        with torch.device("meta"):
            skeleton = nn.Sequential(nn.Linear(512, 96, bias=False))
        loaded = tmac.load(tmp_path / "q4k.safetensors", skeleton)[0]
        assert loaded.spec == want.spec
        with torch.no_grad():
            assert torch.equal(loaded(x), want(x))


def test_ternary_triples_state_round_trip_and_layout_check():
    """Triples packed for NEON load here (repacked); a state without this tmac's triples layout is refused."""
    torch.manual_seed(0)
    qw = tmac.quantize_weight(torch.randn(80, 576), ternary=True, group_size="row")
    arm, local = Linear.from_quantized(qw, isa="neon", triples=True), Linear.from_quantized(qw)
    assert arm.spec.triples  # asked for: NEON's default is 2-bit planes
    fresh = Linear.from_quantized(tmac.quantize_weight(torch.randn(80, 576), ternary=True, group_size="row"))
    fresh.load_state_dict(arm.state_dict())
    x = torch.randn(2, 576)
    with torch.no_grad():
        assert torch.equal(fresh(x), local(x))
    old = arm.state_dict()
    old["_extra_state"] = {k: v for k, v in old["_extra_state"].items() if k != "triples_layout"}
    with pytest.raises(RuntimeError, match="ternary-triples layout"):
        fresh.load_state_dict(old)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 64)
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64, bias=False)
        self.odd = nn.Linear(48, 64)
        self.lm_head = nn.Linear(64, 50, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        return self.lm_head(h + self.down(F.silu(self.up(h))) + self.odd(h[..., :48]))


def test_quantize_model_swaps_exactly_the_eligible_layers():
    torch.manual_seed(0)
    model = _Tiny()
    ids = torch.randint(0, 50, (2, 6))
    with torch.no_grad():
        ref = model(ids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tmac.quantize_model(model, bits=4, group_size=64) is model
    assert [type(m) for m in (model.up, model.down, model.odd, model.lm_head)] == [Linear, Linear, nn.Linear, nn.Linear]
    assert len(caught) == 1 and "odd (in_features=48)" in str(caught[0].message)
    with torch.no_grad():
        err = rel_l2(model(ids).numpy(), ref.numpy())
    print(f"tiny model W4 g64: logits rel L2 {err:.4f}")
    assert err < 0.1

    kinds = {"up": nn.Linear, "down": Linear, "odd": nn.Linear, "lm_head": nn.Linear}  # 48: not a multiple of 32
    m2 = tmac.quantize_model(_Tiny(), bits=2, group_size="row", skip=["up", "lm_*"])
    assert {name: type(getattr(m2, name)) for name in kinds} == kinds
    m3 = tmac.quantize_model(_Tiny(), bits=2, group_size=32, skip=lambda name, mod: mod.out_features == 64)
    # a given skip adds to the head's: lm_head stays float unless quantize_head says otherwise
    assert {name: type(getattr(m3, name)) for name in kinds} == {**kinds, "up": Linear, "down": nn.Linear}
    m4 = tmac.quantize_model(_Tiny(), bits=2, group_size=32, skip=["odd"], quantize_head=True)
    assert type(m4.lm_head) is Linear and type(m4.up) is Linear


def _saved_tiny(tmp_path, bits: int):
    """A quantized ``_Tiny`` saved to ``tmp_path``: (model, ids, its output for them, the file's path)."""
    torch.manual_seed(0)
    model = tmac.quantize_model(_Tiny(), bits=bits, group_size=32)
    ids = torch.randint(0, 50, (1, 5))
    with torch.no_grad():
        ref = model(ids)
    path = tmp_path / "tiny.safetensors"
    tmac.save(model, path)
    return model, ids, ref, path


def test_save_and_load_without_pickle(tmp_path):
    model, ids, ref, path = _saved_tiny(tmp_path, bits=2)
    header = path.read_bytes()[:8]
    assert int.from_bytes(header, "little") < path.stat().st_size  # a safetensors header length, not pickle
    with torch.device("meta"):
        skeleton = _Tiny()
    loaded = tmac.load(path, skeleton)
    assert type(loaded.up) is Linear and type(loaded.odd) is nn.Linear
    with torch.no_grad():
        assert torch.equal(loaded(ids), ref)
    with pytest.raises(TypeError, match="model to fill"):
        tmac.load(path)
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    with pytest.raises(tmac.ModelFormatError, match="junk.safetensors"):
        tmac.load(tmp_path / "junk.safetensors", _Tiny())
    other = _Tiny()  # a skeleton of other shapes: refused, naming the layer, not silently replaced
    other.up = nn.Linear(64, 128)
    with pytest.raises(ValueError, match=r"layer up is out_features x in_features = 256 x 64 in the file but 128 x 64"):
        tmac.load(path, other)


def test_a_saved_file_is_aligned_safetensors_and_loads_as_views_of_its_mapping(tmp_path, monkeypatch):
    """Every tensor starts on a cache-line boundary of the file (checked with the safetensors library's own reader),
    so loading maps the file and the layers use its bytes; a file laid out by safetensors itself (version 1, no
    alignment) still loads, its unaligned tensors copied."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    import tmac.nn.serialize as serialize

    model, ids, ref, path = _saved_tiny(tmp_path, bits=4)
    n = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8:8 + n])
    state = model.state_dict()
    stored = [key for key in header if key in state]  # (a tied weight is stored once, its alias by name)
    assert len(stored) >= 10
    with safe_open(str(path), framework="pt") as f:
        for key in stored:
            assert torch.equal(f.get_tensor(key), state[key]), key
            assert (8 + n + header[key]["data_offsets"][0]) % 64 == 0, key
    with torch.device("meta"):
        loaded = tmac.load(path, _Tiny())
    with torch.no_grad():
        assert torch.equal(loaded(ids), ref)
    file_bytes = torch.from_numpy(np.fromfile(path, np.uint8))
    assert torch.equal(file_bytes[8 + n + header["up.qweight"]["data_offsets"][0]:][:loaded.up.qweight.nbytes],
                       loaded.up.qweight.reshape(-1))

    def unaligned(tmp, tensors, meta):  # what tmac 0.x wrote: safetensors' own layout, file version 1
        info = json.loads(meta["tmac"])
        save_file({"x": torch.zeros(3, dtype=torch.uint8), **tensors}, tmp,
                  metadata={**meta, "tmac": json.dumps({**info, "version": 1})})

    monkeypatch.setattr(serialize, "_write_aligned", unaligned)
    old = tmp_path / "old.safetensors"
    tmac.save(model, old)
    n = int.from_bytes(old.read_bytes()[:8], "little")
    offsets = [e["data_offsets"][0] for k, e in json.loads(old.read_bytes()[8:8 + n]).items() if k != "__metadata__"]
    assert any((8 + n + at) % 64 for at in offsets)  # some tensors unaligned: copied
    with torch.device("meta"):
        loaded = tmac.load(old, _Tiny(), strict=False)
    with torch.no_grad():
        assert torch.equal(loaded(ids), ref)


def test_tiny_transformers_llama():
    import transformers  # test-only dependency (the dev extra)

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        ref = model(ids).logits
    tmac.quantize_model(model, bits=4, group_size=32)
    swapped = sorted(name for name, m in model.named_modules() if isinstance(m, Linear))
    expected = sorted(f"model.layers.{i}.{p}" for i in range(2) for p in
                      ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
    assert swapped == expected and type(model.lm_head) is nn.Linear
    with torch.no_grad():
        logits = model(ids).logits
        for name in swapped:  # the same model with float layers holding the dequantized weights
            parent, _, child = name.rpartition(".")
            lin = model.get_submodule(name)
            plain = nn.Linear(lin.in_features, lin.out_features, bias=False)
            plain.weight.copy_(lin.dequantized_weight())
            setattr(model.get_submodule(parent), child, plain)
        dequant_logits = model(ids).logits
    kernel_err = rel_l2(logits.numpy(), dequant_logits.numpy())
    quant_err = rel_l2(logits.numpy(), ref.numpy())
    print(f"tiny transformers Llama W4 g32: logits rel L2 {kernel_err:.4f} vs dequantized weights, "
          f"{quant_err:.4f} vs float")
    assert kernel_err <= 0.015
    assert quant_err < 0.2  # random N(0, 0.02) weights: ~8 % weight error at 4 bits, compounded over 2 layers


def test_lazy_views_sparse_nested_and_meta_outputs(rng):
    """A lazily negated view is computed with its sign (it was computed as +x); sparse and nested inputs and an
    output on the meta device are refused with TypeError before any kernel runs."""
    from tmac import quantize_weight
    from tmac.execution.lut_ops import LutWeight

    lin = Linear.from_float(torch.from_numpy(rng.standard_normal((64, 256)).astype(np.float32)), bits=2,
                            group_size=64)
    x = torch.from_numpy(rng.standard_normal((2, 256)).astype(np.float32))
    with torch.inference_mode():
        assert torch.equal(lin(x._neg_view()), lin(-x))
        for bad in (x.to_sparse(), x.to_sparse_csr()):
            with pytest.raises(TypeError, match="dense"):
                lin(bad)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch: nested tensors are a prototype
            nested = torch.nested.nested_tensor([x[0], x[1]])
        with pytest.raises(TypeError, match="nested"):
            lin(nested)
        lw = LutWeight.from_quantized(quantize_weight(rng.standard_normal((64, 256)).astype(np.float32), bits=2,
                                                      group_size=64))
        with pytest.raises(TypeError, match="dense CPU tensor"):
            lw.matmul(x, out=torch.empty(2, 64, device="meta"))
        with pytest.raises(ValueError, match="negated"):
            lw.matmul(x._neg_view())


def test_a_hugging_face_model_saved_and_loaded_into_a_meta_skeleton_generates_as_before(tmp_path):
    """LlamaForCausalLM's rotary inv_freq is a buffer outside the state dict, computed at construction: on a
    meta-device skeleton it has no values until tmac.load fills it from the file."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = tmac.quantize_model(transformers.LlamaForCausalLM(config).eval(), bits=4, group_size=32)
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=5, do_sample=False)
    tmac.save(model, tmp_path / "llama.safetensors")
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(config).eval()
    loaded = tmac.load(tmp_path / "llama.safetensors", skeleton)
    assert not any(t.is_meta for t in [*loaded.parameters(), *loaded.buffers()])
    with torch.no_grad():
        assert torch.equal(loaded.generate(ids, max_new_tokens=5, do_sample=False), want)
    # a file without the buffers (as an older tmac wrote) is refused, naming what stays empty
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(tmp_path / "llama.safetensors"), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys() if "inv_freq" not in k}
    meta["tmac"] = meta["tmac"].replace('"buffers": [', '"unused": [')
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata=meta)
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(config).eval()
    with pytest.raises(tmac.ModelFormatError, match=r"does not fill .*inv_freq.*meta device"):
        tmac.load(tmp_path / "old.safetensors", skeleton)


def test_quantize_model_defaults_to_4_bits():
    """2 and 3 bits need a model trained or calibrated for them (README, "Which bit widths are usable"): the
    default is 4."""
    model = tmac.quantize_model(nn.Sequential(nn.Linear(256, 64)))
    assert model[0].format.bits == 4 and tmac.quantize_weight(torch.randn(8, 128)).format.bits == 4
