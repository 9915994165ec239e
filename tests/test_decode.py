"""The static decode path: each glue kernel against a float64 numpy statement of its math, and whole decode steps
against the eager model (itself checked against transformers and llama.cpp in test_models.py)."""
import gc
import weakref

import numpy as np
import pytest
import torch
import transformers

import tmac
from conftest import rel_l2, runnable_isas
from tmac.execution import runtime
from tmac.apps.process import torch_single_threaded
from tmac.base.glue import PARALLEL_ATTENTION_WORK
from tmac.quant.spec import PARALLEL_TABLE_ROWS
from tmac.base.glue import GlueSpec
from tmac.kernels import isa_by_name
from tmac.models.run.decode import DecodePlan


def _glue(isa_name, **shape):
    isa = isa_by_name(isa_name)
    spec = GlueSpec(isa.name, **{"dim": 96, "n_heads": 6, "n_kv_heads": 2, "head_dim": 16, "ffn_dim": 80,
                                 "act": "silu", "sub_norms": False, "act_quant": False, **shape})
    return spec, runtime.load_kernels(spec, isa)


def _rms_ref(x, w, eps):
    return x / np.sqrt(np.mean(x * x) + eps) * w


def _quantize_ref(x):
    scale = 127.0 / max(np.abs(x).max(), 1e-5)
    return np.clip(np.round(x * scale), -128, 127) / scale


@pytest.mark.parametrize("fmt", [dict(bits=8, group_size=32, symmetric=True), dict(bits=4, group_size=32),
                                 dict(bits=3, group_size="row"), dict(bits=2, group_size="tensor"),
                                 dict(bits=1, group_size=32)], ids=["q8_0", "w4g32z", "w3row", "w2tensor", "w1g32"])
def test_embed_gives_the_token_tables_rows(fmt, rng):
    """The compiled token-table lookup returns ``tmac.Embedding``'s rows bit for bit, and refuses a token id outside
    the table by name."""
    from tmac.models.run.decode import glue_spec
    from tmac.models.family.llama import LlamaConfig

    table = tmac.Embedding(tmac.quantize_weight(rng.standard_normal((300, 96)).astype(np.float32), **fmt))
    cfg = LlamaConfig(vocab_size=300, dim=96, n_layers=1, n_heads=6, n_kv_heads=2, head_dim=16, ffn_dim=80)
    isa = isa_by_name(runnable_isas()[0])
    spec = glue_spec(cfg, False, isa, "float16", table)
    assert spec.embed_bits == fmt["bits"] and "embed" in spec.functions and f"_e{fmt['bits']}g" in spec.name
    glue = runtime.load_kernels(spec, isa)
    params = [t for t in (table.codes, table.scales, table.zeros) if t is not None]
    out = torch.full((1, 96), float("nan"))
    for token in (0, 7, 299):
        glue.embed(*params, token, out)
        assert torch.equal(out[0], table.row(token))
    with pytest.raises(ValueError, match="token id outside the table"):
        glue.embed(*params, 300, out)


@pytest.mark.parametrize("isa", runnable_isas())
def test_norms_and_activations_match_their_math(isa, rng):
    spec, g = _glue(isa, sub_norms=True, act_quant=True)
    x, d = rng.standard_normal((2, 1, 96)).astype(np.float32)
    w = rng.standard_normal(96).astype(np.float32)
    xt, out = torch.from_numpy(x.copy()), torch.zeros(1, 96)
    g.norm_final(xt, torch.from_numpy(d), torch.from_numpy(w), 1e-5, out)
    ref_x = x.astype(np.float64) + d
    np.testing.assert_allclose(xt.numpy(), ref_x, rtol=1e-6)
    np.testing.assert_allclose(out.numpy(), _rms_ref(ref_x, w, 1e-5), rtol=1e-5, atol=1e-6)
    g.quantize_dim(out)
    q = _quantize_ref(_rms_ref(ref_x, w, 1e-5))
    step = np.abs(q).max() / 127  # a value at a rounding tie may land one step away
    assert np.abs(out.numpy() - q).max() <= step * 1.001 and np.mean(np.abs(out.numpy() - q) < 1e-5) > 0.98
    h = rng.standard_normal((1, 80)).astype(np.float32)
    out_h = torch.zeros(1, 80)
    g.norm_hidden(torch.from_numpy(h), torch.from_numpy(w[:80]), 1e-6, out_h)
    np.testing.assert_allclose(out_h.numpy(), _rms_ref(h.astype(np.float64), w[:80], 1e-6), rtol=1e-5, atol=1e-6)
    g.quantize_ffn(out_h)
    codes = out_h.numpy() * 127 / np.abs(out_h.numpy()).max()
    np.testing.assert_allclose(codes, np.round(codes), atol=1e-4)  # on the int8 grid
    gu = rng.standard_normal((1, 160)).astype(np.float32) * 4
    gu[0, :10] = [-100, -88.5, -87.5, -40, -1e-7, 1e-7, 40, 87.5, 88.5, 100]  # the clamped ends of the kernel's exp
    for act, ref in (("silu", lambda a: a / (1 + np.exp(-a))), ("relu2", lambda a: np.maximum(a, 0) ** 2)):
        _, ga = _glue(isa, act=act)
        out_a = torch.zeros(1, 80)
        ga.gated_act(torch.from_numpy(gu), out_a)
        g64 = gu.astype(np.float64)
        np.testing.assert_allclose(out_a.numpy(), ref(g64[:, :80]) * g64[:, 80:], rtol=2e-6, atol=1e-6)


def _attend_ref(qkv, cos, sin, ck, cv, pos, h, kv, hd, bias=None, norms=None, window=0, scale=None, softcap=0.0):
    """The q/k/v biases and per-head q/k RMSNorms (``norms``: q weights, k weights, eps) where given, RoPE ("rotate
    half") over cos's width of each head, the cache write at ``pos`` (rounded to the caches' dtype) and
    grouped-query attention over ``0..pos`` (the last ``window`` positions, where given), in float64. Caches
    ``[kv, positions, head_dim]``."""
    qkv, cos, sin = (a.astype(np.float64) for a in (qkv[0], cos[pos, 0], sin[pos, 0]))
    if bias is not None:
        qkv = qkv + bias[0]
    heads = qkv[:(h + kv) * hd].reshape(h + kv, hd)
    if norms is not None:
        wq, wk, eps = norms
        heads = heads / np.sqrt(np.mean(heads * heads, axis=1, keepdims=True) + eps) * \
            np.concatenate([np.tile(wq, (h, 1)), np.tile(wk, (kv, 1))])
    r = cos.shape[-1]
    rot = np.concatenate([-heads[:, r // 2:r], heads[:, :r // 2]], axis=1)
    roped = np.concatenate([heads[:, :r] * cos + rot * sin, heads[:, r:]], axis=1)
    ck, cv = ck.copy(), cv.copy()
    ck[:, pos] = roped[h:]
    cv[:, pos] = qkv[(h + kv) * hd:].reshape(kv, hd)
    ck, cv = ck.astype(np.float64), cv.astype(np.float64)
    out = np.empty((h, hd))
    first = max(0, pos + 1 - window) if window else 0
    for head in range(h):
        kh = head // (h // kv)
        s = ck[kh, first:pos + 1] @ roped[head] * (scale or hd ** -0.5)
        s = softcap * np.tanh(s / softcap) if softcap else s
        p = np.exp(s - s.max())
        out[head] = (p / p.sum()) @ cv[kh, first:pos + 1]
    return out.reshape(1, -1), ck, cv


def _key_blocks(keys):
    """``[kv, positions, head_dim]`` keys in the cache's layout ``[kv, positions/16, head_dim, 16]`` (positions
    padded with zeros to whole blocks of 16)."""
    kv, n, hd = keys.shape
    nb = -(-n // 16)
    padded = np.zeros((kv, nb * 16, hd), keys.dtype)
    padded[:, :n] = keys
    return np.ascontiguousarray(padded.reshape(kv, nb, 16, hd).transpose(0, 1, 3, 2))


def _keys_of_blocks(blocks, n):
    """The first ``n`` positions ``[..., n, head_dim]`` of keys in the cache's layout ``[..., blocks, head_dim, 16]``."""
    *lead, nb, hd, _ = blocks.shape
    return np.swapaxes(blocks, -1, -2).reshape(*lead, nb * 16, hd)[..., :n, :]


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("heads", [(6, 2, 16), (4, 4, 20), (8, 1, 64)], ids=["gqa", "mha-hd20", "mqa"])
@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
def test_attend_matches_its_math(isa, heads, kv_dtype, rng):
    h, kv, hd = heads
    _, g = _glue(isa, n_heads=h, n_kv_heads=kv, head_dim=hd, kv_dtype=kv_dtype)
    parallel = -(-PARALLEL_ATTENTION_WORK // (h * hd)) - 1  # the first position attended in parallel
    ctx = parallel + 9  # keys score in blocks of 16 positions; the softmax runs over whole vectors (4, 8 or 16 lanes)
    cached = -(-ctx // 16) * 16  # the positions of whole key blocks
    angles = rng.uniform(0, 6, (ctx, 1, hd // 2))
    cos = np.cos(np.concatenate([angles, angles], -1)).astype(np.float32)
    sin = np.sin(np.concatenate([angles, angles], -1)).astype(np.float32)
    for pos in (0, 5, 15, 16, 31, 32, 39, parallel - 1, parallel, ctx - 1):  # serially, then in parallel
        qkv = rng.standard_normal((1, (h + 2 * kv) * hd)).astype(np.float32)
        ck, cv = rng.standard_normal((2, kv, cached, hd)).astype(kv_dtype)
        ref, ref_k, ref_v = _attend_ref(qkv, cos, sin, ck, cv, pos, h, kv, hd)
        tk, tv, out = torch.from_numpy(_key_blocks(ck)), torch.from_numpy(cv.copy()), torch.zeros(1, h * hd)
        g.attend(torch.from_numpy(qkv), torch.from_numpy(cos), torch.from_numpy(sin), tk, tv,
                 torch.zeros(h, cached), pos, out)
        # float16: the kernel rounds its float32 rotation, the reference its float64 one: one unit apart at most
        np.testing.assert_allclose(_keys_of_blocks(tk.numpy(), cached), ref_k,
                                   rtol=1e-3 if kv_dtype == "float16" else 1e-5, atol=1e-6)
        np.testing.assert_array_equal(tv.numpy(), ref_v)
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", [{"qkv_bias": True}, {"qk_norm": True}, {"window": True}, {"rotary_dim": 12},
                                     {"attn_scale": 0.3}, {"softcap": 0.7}, {"window": True, "softcap": 2.5},
                                     {"qkv_bias": True, "qk_norm": True, "window": True, "rotary_dim": 8,
                                      "attn_scale": 0.2}],
                         ids=["bias", "qk_norm", "window", "rotary12", "scale", "softcap", "window-softcap", "all"])
def test_attend_variants_match_their_math(variant, rng):
    """Qwen2's biases, Qwen3's and Gemma's q/k norms, sliding windows (shorter, longer and not a multiple of the key
    blocks), partial rotary dimensions, a given scale and Gemma 2's soft cap, each against the float64 statement."""
    isa = runnable_isas()[0]
    h, kv, hd = 6, 2, 16
    spec, g = _glue(isa, **variant)
    ctx = 70
    cached = -(-ctx // 16) * 16
    rot = variant.get("rotary_dim", hd)
    angles = np.arange(cached)[:, None, None] * rng.uniform(0.01, 1, rot // 2)
    angles = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    for pos, window in ((0, 5), (3, 5), (20, 5), (40, 17), (69, 32), (69, 0), (50, 100)):
        if not variant.get("window") and window:
            continue
        qkv = rng.standard_normal((1, (h + 2 * kv) * hd)).astype(np.float32)
        bias = rng.standard_normal((1, (h + 2 * kv) * hd)).astype(np.float32)
        wq, wk = rng.uniform(0.5, 1.5, (2, hd)).astype(np.float32)
        ck, cv = rng.standard_normal((2, kv, cached, hd)).astype(np.float16)
        ref, ref_k, _ = _attend_ref(qkv, cos, sin, ck, cv, pos, h, kv, hd,
                                    bias if spec.qkv_bias else None, (wq, wk, 1e-6) if spec.qk_norm else None,
                                    window if spec.window else 0, spec.attn_scale or None, spec.softcap)
        tk, out = torch.from_numpy(_key_blocks(ck)), torch.zeros(1, h * hd)
        named = dict(qkv=torch.from_numpy(qkv), bias=torch.from_numpy(bias), q_norm=torch.from_numpy(wq),
                     k_norm=torch.from_numpy(wk), eps=1e-6, cos=torch.from_numpy(cos), sin=torch.from_numpy(sin),
                     cache_k=tk, cache_v=torch.from_numpy(cv.copy()), scores=torch.zeros(h, cached), pos=pos,
                     window=window, out=out)
        g.attend(*[named[n] for n in spec.attend_args])
        np.testing.assert_allclose(_keys_of_blocks(tk.numpy(), cached)[:, pos], ref_k[:, pos], rtol=1e-3, atol=1e-6)
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=2e-5, err_msg=f"pos {pos}, window {window}")


@pytest.mark.parametrize("variant", [{}, {"qkv_bias": True}, {"qk_norm": True}, {"window": True},
                                     {"qkv_bias": True, "qk_norm": True, "window": True, "rotary_dim": 8}])
def test_attend_takes_its_arguments_in_the_order_the_decode_plan_passes_them(variant):
    from tmac.codegen.attention import attend_func

    spec = GlueSpec("avx2", 96, 6, 2, 16, 80, "silu", False, False, **variant)
    params, names = attend_func(spec, 8, 16).params, spec.attend_args
    assert len(params) == len(names)  # (buffers are unnamed in TIR; the scalars are named)
    scalars = {"pos": "int32", "window": "int32", "eps": "float32"}
    assert {i: str(p.ty) for i, p in enumerate(params) if str(p.ty) in ("int32", "float32")} == \
        {i: scalars[n] for i, n in enumerate(names) if n in scalars}
    assert [params[i].name for i, n in enumerate(names) if n in scalars] == [n for n in names if n in scalars]


def test_attend_refuses_positions_outside_the_cache():
    isa = runnable_isas()[0]
    _, g = _glue(isa)
    ctx = 8
    args = [torch.zeros(1, 10 * 16), torch.zeros(ctx, 1, 16), torch.zeros(ctx, 1, 16),
            torch.zeros(2, 1, 16, 16, dtype=torch.float16), torch.zeros(2, 16, 16, dtype=torch.float16),
            torch.zeros(6, 16)]
    for pos in (ctx, -1, 1 << 30):
        with pytest.raises(ValueError, match="outside the KV cache"):
            g.attend(*args, pos, torch.zeros(1, 96))
    with pytest.raises(ValueError):  # a scores buffer shorter than the cache
        g.attend(*args[:5], torch.zeros(6, 15), 3, torch.zeros(1, 96))
    with pytest.raises(TypeError, match="dtype"):  # a float32 cache for a float16 kernel
        g.attend(*args[:3], torch.zeros(2, 1, 16, 16), torch.zeros(2, 16, 16), args[5], 3, torch.zeros(1, 96))
    long_cos = [torch.zeros(40, 1, 16)] * 2  # RoPE tables longer than the cache
    with pytest.raises(ValueError, match="outside the KV cache"):
        g.attend(args[0], *long_cos, *args[3:], 20, torch.zeros(1, 96))


def _tiny(tmp_path, bitnet=False):
    kw = dict(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    if bitnet:
        hf = transformers.BitNetForCausalLM(transformers.BitNetConfig(**kw))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    hf.eval().save_pretrained(tmp_path)


@pytest.mark.parametrize("case", ["llama-w4", "llama-w4-float-head", "llama-w4-float16-head", "llama-w2-head-w4",
                                  "bitnet-ternary", "llama-ternary"])
def test_decode_plan_matches_the_eager_model(tmp_path, case):
    _tiny(tmp_path, bitnet=case.startswith("bitnet"))
    if case.endswith("ternary"):
        # ternary projections with int8 activations in front, as BitNet checkpoints and llama.cpp's TQ1_0/TQ2_0
        # files load (the latter in a Llama, the head too)
        model = tmac.load_model(tmp_path, context=64)
        for layer in model.layers:
            for name in ("wqkv", "wo"):
                setattr(layer.attention, name, _ternary(getattr(layer.attention, name)))
            for name in ("w13", "w2"):
                setattr(layer.feed_forward, name, _ternary(getattr(layer.feed_forward, name)))
        if case == "llama-ternary":
            model.output = _ternary(model.output)
    else:
        bits, head = {"llama-w4": (4, None), "llama-w4-float-head": (4, "float"), "llama-w4-float16-head": (4, "float"),
                      "llama-w2-head-w4": (2, 4)}[case]
        model = tmac.load_model(tmp_path, bits=bits, head_bits=head, group_size=64, context=64)
        if case == "llama-w4-float16-head":  # as a 16-bit file's head loads: rounded inputs, widened outputs
            model.output.weight = torch.nn.Parameter(model.output.weight.half(), requires_grad=False)
    prompt = list(range(3, 40))
    with torch.inference_mode():
        tmac.Session(model).logits(prompt)
        plan = DecodePlan.build(model)
        assert plan is not None
        saved = model.cache_k.clone(), model.cache_v.clone()
        eager = [model(torch.tensor([t]), len(prompt) + i, last_only=True)[-1].clone() for i, t in enumerate((7, 9))]
        eager_cache = model.cache_k.clone(), model.cache_v.clone()
        model.cache_k.copy_(saved[0])
        model.cache_v.copy_(saved[1])
        fast = [plan.step(t, len(prompt) + i).clone() for i, t in enumerate((7, 9))]
    # the paths differ in summation order only, which int8 table rounding (and BitNet's int8 activations) amplify:
    # with int8 activations a step is either identical or one activation lands on the other side of a rounding
    # boundary, which moves these tiny models' logits by 1-3 % (6 seeds on an AMD EPYC: 5 of 12 steps identical,
    # the rest 1.0-3.0 %)
    tol = 5e-2 if case.endswith("ternary") else 2e-3
    for e, f in zip(eager, fast):
        assert rel_l2(f.numpy(), e.numpy()) < tol
    new, end = slice(len(prompt), len(prompt) + 2), len(prompt) + 2
    caches = [(_keys_of_blocks(k.float().numpy(), end), v[:, :, :end].float().numpy())
              for k, v in ((model.cache_k, model.cache_v), eager_cache)]
    for got, want in zip(*caches):
        assert rel_l2(got[:, :, new], want[:, :, new]) < tol
        np.testing.assert_array_equal(got[:, :, :len(prompt)], want[:, :, :len(prompt)])
    with pytest.raises(ValueError, match="outside the context"):
        plan.step(1, 64)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        plan.step(256, 1)


def _ternary(module):
    from tmac.models.family.bitnet import ActivationQuantized

    inner = module.linear if isinstance(module, ActivationQuantized) else module
    return ActivationQuantized(tmac.Linear.from_float(inner.weight.detach(), ternary=True))


def test_generation_uses_the_plan_and_agrees_with_eager(tmp_path):
    _tiny(tmp_path)
    model = tmac.load_model(tmp_path, bits=4, group_size=64, context=64)
    assert isinstance(model.tok_embeddings, tmac.Embedding)  # requantized: the token table is 8-bit too
    assert model.tok_embeddings.format.name == "w8g32s" and model.tok_embeddings.codes.dtype == torch.uint8
    prompt = list(range(5, 25))
    fast = tmac.Session(model).generate(prompt, max_new_tokens=12, ignore_eos=True, temperature=0)
    assert tmac.Session(model, static_decode=False).generate(prompt,
            max_new_tokens=12, ignore_eos=True, temperature=0) == fast
    float_model = tmac.load_model(tmp_path, context=64)
    with torch.inference_mode():
        tmac.Session(float_model).logits(prompt)
    assert DecodePlan.build(float_model) is None  # float projections: generation stays eager


def test_generation_keeps_its_plan_until_the_model_changes(tmp_path):
    """The plan is built once (kernels compiled before the timers start) and reused while nothing it points into
    changed; a swapped projection or a new cache gets a new plan, whose tokens are the eager model's."""
    _tiny(tmp_path)
    model = tmac.load_model(tmp_path, bits=4, group_size=64, context=64)
    prompt, session = list(range(5, 25)), tmac.Session(model)

    def generate():
        session.cached_ids = []
        ids = session.generate(prompt, max_new_tokens=6, ignore_eos=True, temperature=0)
        assert session.stats["decode_steps"] == 5 and session.stats["setup_s"] > 0
        return ids, session.decode_plan()

    first, plan = generate()
    assert isinstance(plan, DecodePlan) and generate() == (first, plan)
    model.layers[1].feed_forward.w2 = tmac.Linear.from_float(torch.randn(128, 384), bits=2, group_size=64)
    swapped, new_plan = generate()
    assert new_plan is not plan and swapped != first  # the old plan would have run the old weights
    eager = tmac.Session(model, static_decode=False)
    assert eager.generate(prompt, max_new_tokens=6, ignore_eos=True, temperature=0) == swapped  # the new plan is right
    model.setup_cache(48)
    assert generate()[1] is not new_plan


def test_a_deleted_model_is_freed_at_once_with_its_plan(tmp_path):
    """A session keeps the model and its plan, and the plan holds no reference back: a deleted session's model
    returns its memory at once, not at the cyclic garbage collector's next run."""
    _tiny(tmp_path)
    model = tmac.load_model(tmp_path, bits=4, group_size=64, context=64)
    session = tmac.Session(model)
    session.generate(list(range(5, 25)), max_new_tokens=4, ignore_eos=True, temperature=0)
    assert isinstance(session.decode_plan(), DecodePlan)
    gc.disable()
    try:
        ref = weakref.ref(model)
        del model, session
        assert ref() is None
    finally:
        gc.enable()


def test_generation_leaves_torch_threads_to_the_process_owner(tmp_path, monkeypatch):
    """Library code never changes torch's thread count: a session generates with torch as the caller set it. The
    command line, which owns its process, sets one thread for a model with LUT layers (torch's threads would spin
    on the kernels' cores) and leaves a float model's (``tmac.apps.process.own_torch_threads``, called by
    ``load_for_generation``)."""
    from tmac.apps.cli_generate import load_for_generation
    from tmac.models.run.sampling import Sampler

    original = Sampler.sample
    _tiny(tmp_path)
    before, kernels_before = torch.get_num_threads(), tmac.get_num_threads()
    try:
        for bits, owned in ((4, 1), (None, 2)):
            torch.set_num_threads(2)
            tmac.set_num_threads(2)
            model = tmac.load_model(tmp_path, bits=bits, group_size=64, context=64)
            seen, session = [], tmac.Session(model)

            def sampling(*args, **kwargs):  # runs inside each decode step
                seen.append(torch.get_num_threads())
                return original(*args, **kwargs)

            monkeypatch.setattr(Sampler, "sample", sampling)
            session.generate(list(range(5, 25)), max_new_tokens=3, ignore_eos=True, temperature=0)
            monkeypatch.undo()
            assert seen == [2] * 3 and torch.get_num_threads() == 2
            load_for_generation(str(tmp_path), bits=bits, group_size=64, context=64, progress=False)
            assert torch.get_num_threads() == owned
    finally:
        torch.set_num_threads(before)
        tmac.set_num_threads(kernels_before)


def _types(weight_type: str):
    """A GGML type for every matrix, or for ``Q4_K_M`` llama.cpp's mixture of it: Q6_K for the tables, every v and
    down projection, Q4_K elsewhere (a Q6_K v beside Q4_K q and k in one fused projection)."""
    if weight_type != "Q4_K_M":
        return weight_type
    return lambda name: "Q6_K" if name.split(".")[-2] in ("token_embd", "output", "attn_v", "ffn_down") else "Q4_K"


@pytest.mark.parametrize("family, weight_type, n", [
    ("llama", "Q4_0", 3), ("bitnet", "TQ2_0", 3), ("qwen2", "Q4_1", 3), ("qwen3", "Q8_0", 3), ("gemma3", "Q4_0", 3),
    ("phi3", "Q5_0", 3), ("llama", "Q4_K_M", 3), ("llama", "Q4_0", PARALLEL_TABLE_ROWS),
    ("bitnet", "TQ2_0", PARALLEL_TABLE_ROWS), ("llama", "Q4_K_M", PARALLEL_TABLE_ROWS)])
def test_a_plan_for_several_sequences_gives_each_what_it_gives_alone(tmp_path, family, weight_type, n):
    """``DecodePlan.build(model, rows)``: the glue row by row (from ``PARALLEL_TABLE_ROWS`` rows, its ``_rows``
    variants where they exist), each projection's LUT GEMM once for all the rows; every row's logits equal, bit for
    bit, the one-row plan's for that sequence, step after step (the sequences at different positions, a window
    outgrown)."""
    from tmac.models.family.llama import LlamaConfig
    from tmac.models.run.sequence import Sequence
    from tmac.models.files.synthetic import write_random_gguf

    cfg = LlamaConfig(vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, context_length=640)
    write_random_gguf(str(tmp_path / "m.gguf"), cfg, _types(weight_type), family=family)
    model = tmac.load_model(str(tmp_path / "m.gguf"), context=640, progress=False)
    prompts = [[1, 2, 3], list(range(5, 25)), [i % 500 for i in range(40, 560)]]  # the last past Gemma 3's window
    prompts = [[10 + i, *prompts[i % 3]] for i in range(n)]
    with torch.inference_mode(), torch_single_threaded():
        one, several = DecodePlan.build(model), DecodePlan.build(model, rows=n)
        assert one is not None and several is not None and several.rows == n
        together, alone = ([Sequence(model, adopt=False) for _ in prompts] for _ in range(2))
        for p, a, b in zip(prompts, together, alone):
            model(torch.tensor(p), 0, cache=a)
            model(torch.tensor(p), 0, cache=b)
        tokens = [7 + i for i in range(n)]
        for step in range(4):
            at = [len(p) + step for p in prompts]
            rows = several.step_rows(tokens, at, together).clone()
            single = torch.stack([one.step(t, pos, s).clone() for t, pos, s in zip(tokens, at, alone)])
            assert torch.equal(rows, single), step
            tokens = [int(r.argmax()) for r in rows]
        with pytest.raises(ValueError, match=f"steps {n} sequences"):
            several.step_rows(tokens[:2], at[:2], together[:2])


@pytest.mark.parametrize("family, weight_type", [("llama", "Q4_0"), ("bitnet", "TQ2_0"), ("qwen2", "Q4_1"),
                                                 ("gemma2", "Q8_0"), ("gemma3", "Q4_0"), ("llama", "Q4_K_M")])
@pytest.mark.parametrize("dot_rows", ["0", ""])
def test_a_prefill_plan_gives_what_a_token_by_token_decode_gives(tmp_path, family, weight_type, dot_rows,
                                                                 monkeypatch):
    """A prompt prefilled through the model's prefill plans (``generate.prefill`` with ``Plans``: every projection
    once for a chunk, the glue's ``_rows`` variants on the pool, attention row by row) leaves the logits and the KV
    cache that feeding it one token at a time through the one-row plan leaves, bit for bit: for one token, counts
    whose plan repeats its last row below 16 rows (glue row by row) and past (``_rows`` variants), 16, and a prompt
    of two chunks past Gemma 3's window. Against the eager model, within the plan's usual distance. With table
    lookups only (``TMAC_DOT_ROWS=0``) at every count; by default a prompt's rows take dot products on int8
    activations where a projection's kernels have them (3- to 6-bit codes on x86), and are then within the plan's
    usual distance of the one-row plan (two roundings of the activations, each as close to the
    exact model as llama.cpp's: ``tests/test_dot_kernels.py``)."""
    from tmac.models.run.decode import Plans, multiplies
    from tmac.models.run.generate import PREFILL_CHUNK, prefill
    from tmac.models.family.llama import LlamaConfig
    from tmac.models.run.sequence import Sequence
    from tmac.models.files.synthetic import write_random_gguf

    monkeypatch.setenv("TMAC_DOT_ROWS", dot_rows)
    cfg = LlamaConfig(vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, context_length=640)
    write_random_gguf(str(tmp_path / "m.gguf"), cfg, _types(weight_type), family=family)
    model = tmac.load_model(str(tmp_path / "m.gguf"), context=640, progress=False)
    plans = Plans(model).current()
    with torch.inference_mode(), torch_single_threaded():
        one = plans.decode(1)
        for n in (1, 13, 16, 37, PREFILL_CHUNK + 44):
            prompt = [(i * 37 + n) % 500 + 3 for i in range(n)]
            chunked, stepped = Sequence(model, adopt=False), Sequence(model, adopt=False)
            chunks = [(end, logits[-1].clone()) for end, logits in prefill(model, prompt, chunked, last_only=True,
                                                                            plans=plans)]
            assert [end for end, _ in chunks] == list(range(min(n, PREFILL_CHUNK), n, PREFILL_CHUNK)) + [n]
            last = chunks[-1][1]
            for pos, token in enumerate(prompt):
                expected = one.step(token, pos, stepped)
            if multiplies(model):
                # (two roundings of the activations apart: up to 4.2 % on this tiny random Q4_K_M file, one token)
                assert float((last - expected).norm() / expected.norm()) < 0.06, n
            else:
                assert torch.equal(last, expected), n
                assert _same_positions(chunked, stepped, n), n
            eager = model(torch.tensor(prompt), 0, last_only=True, cache=Sequence(model, adopt=False))[-1]
            assert float((last - eager).norm() / eager.norm()) < (0.07 if weight_type == "TQ2_0" else
                                                                   0.06 if multiplies(model) else 0.04), n
        if n > 16:
            assert plans.prefill(37).rows == 40 and plans.prefill(37) is plans.prefill(40)  # kept, one per size
            assert plans.prefill(13).rows == 14 and plans.prefill(14) is plans.prefill(13)


def _same_positions(a, b, n: int) -> bool:
    """The keys and values of positions ``0 .. n-1`` equal in two sequences' caches."""
    keys = lambda s: s.k.transpose(-1, -2).flatten(2, 3)[:, :, :n]  # noqa: E731  [layers, kv, positions, hd]
    return torch.equal(keys(a), keys(b)) and torch.equal(a.v[:, :, :n], b.v[:, :, :n])
