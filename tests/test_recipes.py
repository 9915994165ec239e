"""Runs that never import torch: a run from a GGUF's packed copy writes down its decode and prefill plans beside the
copy (models/run/recipe.py); a later ``tmac run`` maps the copy with numpy and runs the recorded calls — the torch
run's tokens, greedy and sampled, for prompts of one token to more than a prefill chunk, on the default model and on
a llama.cpp mix (a Q6_K v beside Q4_K q and k: its prefill plans copy each part's rows into place). A recipe is
keyed (another context, environment or copy misses), checked (a damaged one is removed, a damaged copy is said as a
load says it, and the command line then takes torch, which rebuilds the copy) and goes with its copy."""
import glob
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

import tmac
from conftest import smollm2_path
from tmac.base.errors import ModelFormatError
from tmac.models.files import packed_cache
from tmac.models.run import recipe

MIX = os.path.join(os.path.dirname(__file__), "data", "mixes", "Q4_K_M.gguf")
CONTEXT = 512


def prompts(vocab: int) -> list[list[int]]:
    """One token, a few, more than a prefill plan of the ladder's middle, more than a prefill chunk (256)."""
    return [[7], [1, 5, 17, 42, 99], [(11 * i) % vocab for i in range(37)], [(13 * i + 5) % vocab for i in range(300)]]


def recorded(source: str):
    """The model loaded with torch from its packed copy, its recipe written; and the model read back from it."""
    model = tmac.load_model(source, context=CONTEXT)
    assert model.packed_copy
    session = tmac.Session(model)
    session.generate([1, 2, 3], max_tokens=2, temperature=0)  # (builds the decode plan, as a run does)
    assert recipe.record_run(model, session, model.packed_copy, CONTEXT)
    path = recipe.path_for(model.packed_copy, CONTEXT, model.kv_dtype)
    again = recipe.read(path, model.packed_copy, recipe.key(model.packed_copy, CONTEXT, model.kv_dtype))
    assert again is not None and again.context == model.context == CONTEXT
    return model, again, path


@pytest.mark.parametrize("source", [smollm2_path(), MIX], ids=["smollm2", "Q4_K_M"])
def test_a_recipe_steps_the_model_as_torch_does(cache, tmp_path, source):
    local = str(tmp_path / os.path.basename(source))
    shutil.copyfile(source, local)
    model, lean, _ = recorded(local)
    vocab = model.config.vocab_size
    for prompt in prompts(vocab):
        for options in (dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=3)):
            want = tmac.Session(model).generate(prompt, max_tokens=6, ignore_eos=True, **options)
            session = tmac.Session(lean, plans=lean.plans, sequence=lean.sequence)
            lean.sequence.ids = []
            got = session.generate(prompt, max_tokens=6, ignore_eos=True, **options)
            assert got == want, (len(prompt), options)
    # the next turn of a conversation prefills only what is new, from the cache the recipe's plans share
    lean.sequence.ids = []
    session = tmac.Session(lean, plans=lean.plans, sequence=lean.sequence)
    first = session.generate([1, 5, 17], max_tokens=3, temperature=0, ignore_eos=True)
    more = session.generate([1, 5, 17, *first, 30, 31], max_tokens=3, temperature=0, ignore_eos=True)
    assert session.stats["prefill_tokens"] == 3 and \
        more == tmac.Session(model).generate([1, 5, 17, *first, 30, 31], max_tokens=3, temperature=0, ignore_eos=True)


def test_a_recipe_is_keyed_and_checked(cache, tmp_path, monkeypatch):
    local = str(tmp_path / "model.gguf")
    shutil.copyfile(smollm2_path(), local)
    model, _, path = recorded(local)
    copy = model.packed_copy

    def read():
        return recipe.read(path, copy, recipe.key(copy, CONTEXT, model.kv_dtype))

    assert read() is not None
    # another context or KV dtype is another recipe; another environment misses this one
    assert recipe.path_for(copy, 256, "float16") != path != recipe.path_for(copy, CONTEXT, "float32")
    monkeypatch.setenv("TMAC_DOT_ROWS", "0")
    assert read() is None and os.path.exists(path)
    monkeypatch.delenv("TMAC_DOT_ROWS")
    # damage anywhere in it: removed, not trusted
    good = open(path, "rb").read()
    for at in (20, len(good) // 2, len(good) - 40):
        bad = bytearray(good)
        bad[at] ^= 0x10
        open(path, "wb").write(bytes(bad))
        assert read() is None and not os.path.exists(path)
    open(path, "wb").write(good[:-100])
    assert read() is None and not os.path.exists(path)
    # whole bytes whose calls point past the recipe's table of views: removed too
    (n,) = struct.unpack("<Q", good[:8])
    body = json.loads(good[8:8 + n])
    body["views"] = body["views"][:1]
    text = json.dumps(body).encode()
    data = struct.pack("<Q", len(text)) + text + good[8 + n:-32]
    open(path, "wb").write(data + hashlib.sha256(data).digest())
    assert read() is None and not os.path.exists(path)
    open(path, "wb").write(good)
    assert read() is not None
    # the copy damaged where a layer's weights are: said as a load says it (the command line then takes torch)
    tensors = recipe.CopyTensors(copy)
    at = tensors.tensors["layers.3.feed_forward.w2.qweight"].ctypes.data - tensors.data.ctypes.data
    scales = tensors.tensors["layers.5.attention.wqkv.scales"]
    assert scales.dtype == np.float16
    nan_at = scales.ctypes.data + 2 * 7 - tensors.data.ctypes.data
    del tensors, scales
    st = os.stat(copy)
    kept = _patch(copy, nan_at, np.array([np.nan], np.float16).tobytes())
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ModelFormatError, match="layers.5.attention.wqkv.scales contains NaN"):
        read()
    _patch(copy, nan_at, kept)
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert read() is not None
    with open(copy, "r+b") as f:
        f.seek(at + 100)
        byte = f.read(1)
        f.seek(at + 100)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))  # (its time as it was: damage, not a new copy)
    with pytest.raises(ModelFormatError, match="layers.3.feed_forward.w2.*damaged"):
        recipe.read(path, copy, {**recipe.key(copy, CONTEXT, model.kv_dtype)})
    # a copy written again misses its recipes, and a copy removed takes them with it
    key = os.path.basename(copy).removesuffix(".tmac")
    assert glob.glob(os.path.join(str(cache), key + ".*.plans"))
    packed_cache.remove(key)
    assert not glob.glob(os.path.join(str(cache), key + ".*"))
    # clearing the cache takes a converted file's recipes too (they have no copy of their own)
    open(os.path.join(str(cache), "0123.cdefault.float16.plans"), "wb").close()
    packed_cache.clear()
    assert not glob.glob(os.path.join(str(cache), "*.plans"))


def _patch(path: str, at: int, data: bytes) -> bytes:
    """Write ``data`` at byte ``at`` of ``path``; the bytes it replaced."""
    with open(path, "r+b") as f:
        f.seek(at)
        old = f.read(len(data))
        f.seek(at)
        f.write(data)
    return old


def test_float16_finiteness_by_exponent_bits():
    """A copy's float16 tensors are tested by their exponent bits: every one of the 65536 values as numpy says."""
    values = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    assert [recipe._finite(values[i:i + 1]) for i in range(1 << 16)] == np.isfinite(values).tolist()
    assert recipe._finite(values[:0]) and recipe._finite(np.zeros((3, 0), np.float16))
    assert not recipe._finite(np.array([[1.0, 2.0], [3.0, np.inf]], np.float32))


@pytest.mark.slow
def test_a_second_tmac_run_imports_no_torch(tmp_path):
    """``tmac run`` twice on a GGUF: the first (torch) packs the copy and writes its recipe, the second runs from the
    recipe with torch made unimportable — the same tokens, and ``tmac chat``'s turns the same text; with the copy
    damaged the next run takes torch again, rebuilds the copy and answers the same; a ``.tmac`` file from ``tmac
    convert`` runs without torch from its second run too."""
    source = str(tmp_path / "model.gguf")
    shutil.copyfile(smollm2_path(), source)
    env = dict(os.environ, TMAC_CACHE_DIR=str(tmp_path / "root"), TMAC_MODEL_CACHE="1")
    kernels = os.environ["TMAC_CACHE_DIR"]  # (the suite's compiled kernels, copied: nothing compiles here)
    shutil.copytree(kernels, tmp_path / "root", ignore=shutil.ignore_patterns("*.lock", "models", ".build-*"))
    args = ["run", source, "-p", "Tell me a story", "-n", "6", "--temperature", "0", "--json"]
    no_torch = ("import sys; sys.modules['torch'] = None; sys.argv = ['tmac', *sys.argv[1:]]; "
                "from tmac.apps.cli import main; sys.exit(main())")

    def run(*prefix):
        r = subprocess.run([sys.executable, *prefix, *args], capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    first = run("-m", "tmac.apps.cli")
    second = run("-c", no_torch)
    assert first["torch"] and not second["torch"] and second["packed_copy"]
    assert second["generated_ids"] == first["generated_ids"] and second["prompt_ids"] == first["prompt_ids"]
    assert second["import_s"] < first["import_s"]
    # tmac chat too: two turns, the second prefilling only what the first did not hold
    chat = ["chat", source, "-n", "6", "--temperature", "0"]
    answers = [subprocess.run([sys.executable, *prefix, *chat], input="Hi\nAnd again?\n", capture_output=True,
                              text=True, timeout=600, env=dict(env, **extra))
               for prefix, extra in ((["-m", "tmac.apps.cli"], {"TMAC_RECIPES": "0"}), (["-c", no_torch], {}))]
    assert all(r.returncode == 0 for r in answers), answers[1].stderr
    assert answers[0].stdout == answers[1].stdout and answers[1].stdout.count("\n") >= 2
    # a converted file: its recipe in the cache (not beside the user's file), the same tokens without torch
    converted = str(tmp_path / "model.tmac")
    r = subprocess.run([sys.executable, "-m", "tmac.apps.cli", "convert", source, "-o", converted], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    args[1] = converted
    assert run("-m", "tmac.apps.cli")["torch"]
    again = run("-c", no_torch)
    assert not again["torch"] and again["generated_ids"] == first["generated_ids"]
    assert not glob.glob(str(tmp_path / "*.plans"))
    args[1] = source
    (copy,) = glob.glob(str(tmp_path / "root" / "models" / "*.tmac"))
    with open(copy, "r+b") as f:
        f.seek(os.path.getsize(copy) - 4096)
        f.write(b"\xff" * 64)
    third = run("-m", "tmac.apps.cli")
    assert third["torch"] and third["generated_ids"] == first["generated_ids"]
    assert not run("-c", no_torch)["torch"]
