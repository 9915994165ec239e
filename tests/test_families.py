"""Every architecture record against transformers' own model of its class (tests/families.py): a Hugging Face
checkpoint and a GGUF of the same weights (llama.cpp's names and layout) give transformers' logits and greedy ids
on the float path; quantized GGUFs run on the LUT kernels and the decode plan within the kernels' rounding of the
exact model of the file; a .tmac conversion gives the same; broken files are refused by name."""
import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

import tmac
from conftest import rel_l2
from families import hf_model, write_gguf
from tmac.models.family.arch import ARCHITECTURES
from tmac.models.run.decode import DecodePlan

FAMILIES = ["llama", "mistral", "bitnet", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "granite", "olmo2",
            "smollm3"]
GGUF_FAMILIES = ["llama", "bitnet-silu", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "granite", "olmo2",
                 "smollm3"]  # (llama's GGUF: no window)
QUANTIZED = [("llama", "Q4_0"), ("bitnet-silu", "TQ2_0"), ("qwen2", "Q8_0"), ("qwen3", "Q4_0"), ("gemma2", "Q8_0"),
             ("gemma3", "Q8_0"), ("phi3", "Q4_0"), ("granite", "Q4_0"), ("olmo2", "Q4_0"),
             ("smollm3", "Q4_0")]
IDS = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(7))  # past the windows and LongRoPE's 16


@pytest.fixture(scope="module")
def models():
    return {}


def _hf(models, family):
    if family not in models:
        models[family] = hf_model(family)
    return models[family]


def _absmax_int8(x):
    scale = 127 / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
    return (x * scale).round().clamp(-128, 127) / scale


def _assert_transformers_parity(hf, model):
    with torch.no_grad():
        want = hf(IDS[None]).logits[0].double()
    session = tmac.Session(model)
    got = session.logits(IDS.tolist()).double()
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())
    steps = torch.stack([session.logits(IDS[:n].tolist())[-1] for n in (1, 9, 17, 40)]).double()  # cached prefixes
    assert float((steps - want[[0, 8, 16, 39]]).abs().max()) <= 1e-4 * float(want.abs().max())
    with torch.no_grad():
        hf_ids = hf.generate(IDS[None, :8], max_new_tokens=32, do_sample=False, pad_token_id=0)[0, 8:].tolist()
    assert tmac.Session(model).generate(IDS[:8].tolist(), max_new_tokens=32, ignore_eos=True, temperature=0) == hf_ids


@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_gives_transformers_logits_and_greedy_ids(family, models, tmp_path):
    hf = _hf(models, family)
    hf.save_pretrained(tmp_path)
    model = tmac.load_model(str(tmp_path), kv_dtype="float32", progress=False)
    assert model.config.arch == ("llama" if family == "mistral" else family)
    _assert_transformers_parity(hf, model)


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_a_gguf_of_the_same_weights_gives_transformers_logits_and_greedy_ids(family, models, tmp_path):
    hf = _hf(models, family)
    write_gguf(hf, family, tmp_path / "m.gguf")
    model = tmac.load_model(str(tmp_path / "m.gguf"), kv_dtype="float32", progress=False)
    _assert_transformers_parity(hf, model)


@pytest.mark.parametrize("family,weight_type", QUANTIZED, ids=[f"{f}-{w}" for f, w in QUANTIZED])
def test_a_quantized_gguf_decodes_on_the_lut_kernels(family, weight_type, models, tmp_path):
    """The file's own weights imported exactly, decoded by the static plan (no eager fallback), within the LUT
    kernels' activation rounding of transformers' model holding the file's dequantized weights; converted to .tmac,
    the same logits."""
    hf = _hf(models, family)
    held = write_gguf(hf, family, tmp_path / "m.gguf", weight_type)
    exact = hf_model(family)
    exact.load_state_dict(held, strict=False)
    if weight_type.startswith("TQ"):  # BitNet's own math: int8 per-token absmax activations into ternary layers
        for layer in exact.model.layers.modules():
            if isinstance(layer, torch.nn.Linear):
                layer.register_forward_pre_hook(lambda _, args: (_absmax_int8(args[0]),))
    with torch.no_grad():
        want = exact(IDS[None]).logits[0].double()
    model = tmac.load_model(str(tmp_path / "m.gguf"), progress=False)
    assert any(isinstance(m, tmac.Linear) for m in model.layers.modules()) and DecodePlan.build(model) is not None
    plan = DecodePlan.build(model)
    got = torch.stack([plan.step(int(t), pos).clone() for pos, t in enumerate(IDS)]).double()
    # the tables' int8 rounding (docs/decisions.md, "Activation rounding"); ternary layers round twice (BitNet's
    # int8 activations, then the tables of their sums): 5.2 % here
    assert rel_l2(got, want) < (0.07 if weight_type.startswith("TQ") else 0.04), rel_l2(got, want)
    from tmac.models.files.tmac_file import save_model

    save_model(model, str(tmp_path / "m.tmac"))
    again = tmac.load_model(str(tmp_path / "m.tmac"), progress=False)
    assert again.config == model.config
    assert torch.equal(tmac.Session(again).logits(IDS.tolist()), tmac.Session(model).logits(IDS.tolist()))


def test_tmac_run_generates_from_each_familys_gguf(models, tmp_path):
    for family, weight_type in QUANTIZED:
        path = tmp_path / f"{family}.gguf"
        write_gguf(_hf(models, family), family, path, weight_type)
        run = subprocess.run([sys.executable, "-m", "tmac", "run", str(path), "--prompt", "hello", "--max-new-tokens",
                              "6", "--ignore-eos", "--json"], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        assert json.loads(run.stdout)["generated_tokens"] == 6, run.stdout


def _rewrite(src, dst, drop=None, reshape=None):
    """A copy of GGUF ``src`` without tensor ``drop``, or with tensor ``reshape`` cut to half its rows."""
    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_array(field.name, value)
        else:
            w.add_key_value(field.name, value, kind)
    for t in reader.tensors:
        if t.name == drop:
            continue
        data = np.array(t.data)
        if t.name == reshape:
            data = data[: data.shape[0] // 2]
        w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3", "phi3"])
def test_a_missing_or_misshapen_tensor_is_named(family, models, tmp_path):
    write_gguf(_hf(models, family), family, tmp_path / "m.gguf")
    victim = {"qwen2": "blk.1.attn_k.bias", "qwen3": "blk.0.attn_q_norm.weight", "gemma3": "blk.0.post_ffw_norm.weight",
              "phi3": "blk.1.attn_qkv.weight"}[family]
    _rewrite(tmp_path / "m.gguf", tmp_path / "missing.gguf", drop=victim)
    with pytest.raises(tmac.ModelFormatError, match=victim.replace(".", r"\.")):
        tmac.load_model(str(tmp_path / "missing.gguf"), progress=False)
    _rewrite(tmp_path / "m.gguf", tmp_path / "short.gguf", reshape=victim)
    with pytest.raises(tmac.ModelFormatError, match="shape|rows"):
        tmac.load_model(str(tmp_path / "short.gguf"), progress=False)


def test_an_unknown_architecture_lists_the_supported_ones(models, tmp_path):
    _hf(models, "llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(tmac.ModelFormatError, match="MambaForCausalLM.*" + ".*".join(
            name for a in ARCHITECTURES.values() for name in a.hf[:1])):
        tmac.load_model(str(tmp_path), progress=False)
    write_gguf(_hf(models, "llama"), "llama", tmp_path / "m.gguf")
    reader_arch = tmp_path / "mamba.gguf"
    data = (tmp_path / "m.gguf").read_bytes().replace(b"llama.", b"mamba.").replace(b"\x05\x00\x00\x00\x00\x00\x00\x00llama",
                                                                                       b"\x05\x00\x00\x00\x00\x00\x00\x00mamba")
    reader_arch.write_bytes(data)
    with pytest.raises(tmac.ModelFormatError, match="'mamba'.*" + ".*".join(a.gguf for a in ARCHITECTURES.values())):
        tmac.load_model(str(reader_arch), progress=False)


def test_which_kernels_a_model_needs_has_one_answer(models, tmp_path):
    """``tmac tune --model`` times the formats of the projections the loaded model has — the kernels ``tmac compile
    --model`` builds — whatever the source (here a Q4_0 Qwen2 GGUF with a float32 token table and head)."""
    from tmac.apps import cli
    from tmac.kernels import best_isa
    from tmac.models.run.kernel_specs import model_kernel_specs

    write_gguf(_hf(models, "qwen2"), "qwen2", tmp_path / "m.gguf", "Q4_0")
    model = tmac.load_model(str(tmp_path / "m.gguf"), progress=False)
    have = {(m.format, m.in_features) for m in model.modules() if isinstance(m, tmac.Linear)}
    work = cli.tune_work(cli.build_parser().parse_args(["tune", "--model", str(tmp_path / "m.gguf")]))
    assert set(work) == have and len(work) == len(have)
    specs = model_kernel_specs(str(tmp_path / "m.gguf"), best_isa())
    assert {(s.bits, s.k) for s in specs if hasattr(s, "k")} == {(f.bits, k) for f, k in have}


@pytest.mark.parametrize("family", sorted(ARCHITECTURES))
def test_a_synthetic_file_of_each_family_holds_what_the_record_names(family, tmp_path):
    """``write_random_gguf(family=)`` (the per-family speed rows of ``bench/make_synthetic_gguf.py``) writes the
    record's tensors at the config's shapes, here in llama.cpp's Q4_K_M mixture (Q6_K v beside Q4_K q and k in one
    fused projection, Q6_K down projections and head): the file loads, and its decode plan — every family's own
    computation in the glue — gives the eager model's logits."""
    from tmac.models.family.llama import LlamaConfig
    from tmac.models.files.synthetic import write_random_gguf

    def q4_k_m(name: str) -> str:
        return "Q6_K" if name.endswith(("attn_v.weight", "ffn_down.weight", "output.weight")) else "Q4_K"

    cfg = LlamaConfig(vocab_size=512, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=512, context_length=64)
    write_random_gguf(str(tmp_path / "m.gguf"), cfg, "TQ2_0" if family == "bitnet" else q4_k_m, family=family)
    model = tmac.load_model(str(tmp_path / "m.gguf"), progress=False)
    assert model.config.arch == family
    prompt, apart = list(range(3, 40)), []
    with torch.inference_mode():
        tmac.Session(model).logits(prompt)  # (eager, into the model's own cache)
        plan = DecodePlan.build(model)
        assert plan is not None
        saved = model.cache_k.clone(), model.cache_v.clone()
        for token in (7, 9, 11, 13, 100, 200):  # the next position, from the same cache
            model.cache_k.copy_(saved[0])
            model.cache_v.copy_(saved[1])
            eager = model(torch.tensor([token]), len(prompt), last_only=True)[-1].double()
            model.cache_k.copy_(saved[0])
            model.cache_v.copy_(saved[1])
            apart.append(rel_l2(plan.step(token, len(prompt)).double(), eager))
    # the paths differ in summation order only: a step is the eager one to float rounding (1e-7), or an activation
    # lands on the other side of an int8 table rounding and moves these random models' logits by up to ~1 %
    # (BitNet's int8 activations round twice: 2.5-4 % on every step)
    if family == "bitnet":
        assert max(apart) < 0.06, apart
    else:
        assert sum(d < 1e-5 for d in apart) >= 2 and max(apart) < 0.03, apart
    assert len(tmac.Session(model).generate([1, 2, 3], max_new_tokens=4, ignore_eos=True, temperature=0)) == 4


def test_a_variation_the_plan_was_not_taught_runs_eagerly_not_wrongly(models, tmp_path, monkeypatch):
    """The decode plan computes the config fields it was taught (``decode.TAUGHT``). One it was not — Granite's
    residual multiplier with that teaching taken back, or a field new to the config — makes the plan refuse with a
    warning naming it: the model runs on the eager path, at the exact model's numbers, never the plan's without it."""
    import dataclasses

    from tmac.models.run import decode
    from tmac.models.family.llama import LlamaConfig

    hf = _hf(models, "granite")
    held = write_gguf(hf, "granite", tmp_path / "m.gguf", "Q4_0")
    exact = hf_model("granite")
    exact.load_state_dict(held, strict=False)
    with torch.no_grad():
        want = exact(IDS[None]).logits[0].double()
    model = tmac.load_model(str(tmp_path / "m.gguf"), progress=False)
    assert DecodePlan.build(model) is not None
    taught = tmac.Session(model).logits(IDS.tolist()).double()

    monkeypatch.setattr(decode, "TAUGHT", {k: v for k, v in decode.TAUGHT.items() if k != "residual_scale"})
    with pytest.warns(UserWarning, match="does not compute residual_scale of this granite model"):
        assert DecodePlan.build(model) is None
    eager = tmac.Session(model).logits(IDS.tolist()).double()
    assert rel_l2(eager, want) < 0.04 and rel_l2(taught, want) < 0.04, (rel_l2(eager, want), rel_l2(taught, want))
    assert rel_l2(eager, taught) < 0.02  # (the int8 tables' rounding apart: the same model)
    monkeypatch.undo()

    @dataclasses.dataclass
    class Extended(LlamaConfig):
        new_variation: float = 1.0

    model.config = Extended(**{**dataclasses.asdict(model.config), "new_variation": 2.0})
    with pytest.warns(UserWarning, match="new_variation"):
        assert DecodePlan.build(model) is None
    model.config = Extended(**{**dataclasses.asdict(model.config), "new_variation": 1.0})  # at its default it changes nothing: taught or not
    assert DecodePlan.build(model) is not None
