"""A GGUF is packed once: the first load writes its packed model to the cache (models/files/packed_cache.py), later loads
map that copy. The copy is keyed by the file and by the kernels' layout (a changed file, another ISA, another
generator, other tiling or packing code each miss), written atomically (a failed write leaves nothing), checked when loaded (a damaged copy is
rebuilt, not trusted), bounded in size, and listed and cleared by ``tmac cache``."""
import glob
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch

import tmac
from conftest import smollm2_path
from tmac.models.files import load as load_module
from tmac.models.files import packed_cache

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 28, 2]


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "model.gguf"
    shutil.copyfile(smollm2_path(), path)
    return str(path)


def greedy(model, n=8):
    return tmac.Session(model).generate(PROMPT, max_tokens=n, temperature=0, ignore_eos=True)


def loads_from_source(monkeypatch) -> list:
    """A list that grows each time a model is decoded and packed from its source file."""
    calls, original = [], load_module._from_source

    def counting(*args, **kwargs):
        calls.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(load_module, "_from_source", counting)
    return calls


def test_the_first_load_packs_and_later_loads_map_the_copy(cache, source, monkeypatch):
    direct = greedy(tmac.load_model(source, context=64, packed_copy=False))
    packed = loads_from_source(monkeypatch)
    first = tmac.load_model(source, context=64)
    assert first.packed_copy and os.path.dirname(first.packed_copy) == str(cache) and len(packed) == 1
    assert first.source == source  # (names and notes speak of the file the user gave)
    second = tmac.load_model(source, context=64)
    assert second.packed_copy == first.packed_copy and len(packed) == 1  # mapped, not packed again
    assert greedy(first) == greedy(second) == direct
    assert [e["source"] for e in packed_cache.entries()] == [os.path.realpath(source)]


def test_a_run_goes_on_while_its_copy_is_written_behind_it(cache, source, monkeypatch):
    """``copy_behind`` (``tmac run``, ``tmac serve``): the first load returns with the model packed in memory, its token
    table held as the copy holds it, and generates while the copy is still being written; the copy, once whole, is
    the next load's, with the same tokens and the same glue kernel."""
    from tmac.kernels import best_isa
    from tmac.models.run.decode import glue_spec
    from tmac.nn import serialize

    direct = greedy(tmac.load_model(source, context=64, packed_copy=False))
    release, write = threading.Event(), serialize._write_aligned

    def held_back(*args):
        assert release.wait(120)
        return write(*args)

    monkeypatch.setattr(serialize, "_write_aligned", held_back)
    packed = loads_from_source(monkeypatch)
    first = tmac.load_model(source, context=64, copy_behind=True)
    assert first.packed_copy is None and not glob.glob(str(cache / "*.tmac"))
    assert greedy(first) == direct  # (the copy held back meanwhile)
    release.set()
    packed_cache.wait()
    assert first.packed_copy and os.path.isfile(first.packed_copy) and len(packed) == 1
    second = tmac.load_model(source, context=64)
    assert second.packed_copy == first.packed_copy and len(packed) == 1
    assert greedy(second) == direct
    spec = [glue_spec(m.config, False, best_isa(), "float16", m.tok_embeddings, held=True) for m in (first, second)]
    assert spec[0] == spec[1] and type(first.tok_embeddings) is type(second.tok_embeddings)


def test_a_load_waits_for_its_own_copy_being_written(cache, source, monkeypatch):
    """A second load in the process while the first's copy is written maps that copy when whole, not packing again."""
    from tmac.nn import serialize

    write = serialize._write_aligned
    started = threading.Event()

    def slow(*args):
        started.set()
        return write(*args)

    monkeypatch.setattr(serialize, "_write_aligned", slow)
    packed = loads_from_source(monkeypatch)
    first = tmac.load_model(source, context=64, copy_behind=True)
    assert started.wait(120)
    second = tmac.load_model(source, context=64)
    assert len(packed) == 1 and second.packed_copy and second.packed_copy == first.packed_copy


def test_a_process_ends_only_after_its_copy_is_whole(tmp_path, source):
    """The copy's thread is no daemon: a process that loads with ``copy_behind`` and ends at once leaves a whole copy,
    which maps with the source's tokens."""
    code = "import sys, tmac; tmac.load_model(sys.argv[1], context=64, copy_behind=True)"
    env = dict(os.environ, TMAC_CACHE_DIR=str(tmp_path / "root"), TMAC_MODEL_CACHE="1")
    r = subprocess.run([sys.executable, "-c", code, source], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    (copy,) = glob.glob(str(tmp_path / "root" / "models" / "*.tmac"))
    assert greedy(tmac.load_model(copy, context=64)) == greedy(tmac.load_model(source, context=64, packed_copy=False))


@pytest.mark.slow
def test_ctrl_c_while_the_copy_is_written_ends_the_run_and_the_next_writes_it(tmp_path, source):
    """``tmac run`` done, its copy still being written (held back here): Ctrl-C ends the process at once, exit 130,
    no traceback and no copy; the next run packs it again, removes the temporary the first left, and maps it."""
    import signal
    import time

    env = dict(os.environ, TMAC_CACHE_DIR=str(tmp_path / "root"), TMAC_MODEL_CACHE="1")
    shutil.copytree(os.environ["TMAC_CACHE_DIR"], tmp_path / "root", ignore=shutil.ignore_patterns("*.lock", "models", ".build-*"))
    held = ("import sys, time\nfrom tmac.nn import serialize\nwrite = serialize._write_aligned\n"
            "serialize._write_aligned = lambda *a: (time.sleep(300), write(*a))[1]\n"
            "from tmac.apps.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    run = ["run", source, "-p", "Hi", "-n", "2", "--temperature", "0", "--json"]
    proc = subprocess.Popen([sys.executable, "-c", held, *run], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    seen = []
    for line in proc.stderr:  # (the command is done and waits for its copy)
        seen.append(line)
        if "finishing the packed copy" in line:
            break
    assert any("finishing the packed copy" in line for line in seen), "".join(seen)
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.monotonic() - started < 30
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "interrupted", err
    assert json.loads(out)["packing_copy"] is True
    models = tmp_path / "root" / "models"
    assert not glob.glob(str(models / "*.tmac")) and glob.glob(str(models / ".*"))  # (a temporary, left)
    for mapped in (False, True):
        r = subprocess.run([sys.executable, "-m", "tmac.apps.cli", *run], capture_output=True, text=True, timeout=600,
                           env=env)
        assert r.returncode == 0 and json.loads(r.stdout)["packed_copy"] is mapped, r.stderr
    assert len(glob.glob(str(models / "*.tmac"))) == 1 and not glob.glob(str(models / ".*"))


def test_a_changed_file_another_isa_or_generator_misses(cache, source, monkeypatch):
    packed = loads_from_source(monkeypatch)
    tmac.load_model(source, context=64)
    tmac.load_model(source, context=64)
    assert len(packed) == 1
    os.utime(source, ns=(0, 10 ** 18))  # the same bytes, another modification time
    tmac.load_model(source, context=64)
    assert len(packed) == 2
    with open(source, "r+b") as f:  # the same size and time, other bytes at the end
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    os.utime(source, ns=(0, 10 ** 18))
    tmac.load_model(source, context=64)
    assert len(packed) == 3
    from tmac.quant import cache as kernel_cache
    from tmac import kernels

    monkeypatch.setattr(kernel_cache, "generator_digest", lambda: "another generator")
    tmac.load_model(source, context=64)
    assert len(packed) == 4
    # the default tilings, the packing and the importers are code outside the generator: changed, they miss too
    # (a copy packed for other tilings would be repacked on every load)
    hashed = []
    monkeypatch.setattr(kernel_cache, "source_digest", lambda paths: hashed.extend(paths) or "another packer")
    tmac.load_model(source, context=64)
    assert len(packed) == 5
    assert {"choose.py", "packing.py", "kquant.py"} <= {os.path.basename(p) for p in hashed}
    monkeypatch.undo()
    packed = loads_from_source(monkeypatch)
    monkeypatch.setenv("TMAC_MODEL_CACHE", "1")
    monkeypatch.setattr(packed_cache, "directory", lambda: str(cache))
    other = next((n for n in ("avx2", "avx512_vnni") if n != kernels.best_isa().name
                  and n in __import__("conftest").runnable_isas()), None)
    if other is not None:
        monkeypatch.setenv("TMAC_ISA", other)
        tmac.load_model(source, context=64)
        assert len(packed) == 1
    assert len(packed_cache.entries()) == 5 + (other is not None)


def test_a_copy_packed_by_other_code_is_packed_again_once(cache, source, monkeypatch):
    """A copy whose key misses a change in the code that packs (here the default K chunk, under an unchanged key)
    is repacked as it loads — the same tokens — and written again as it now is: the next load maps it as it is."""
    from tmac.nn.linear import respec
    from tmac.quant import choose

    want = greedy(tmac.load_model(source, context=64))
    key = packed_cache.layout()
    monkeypatch.setattr(packed_cache, "layout", lambda: key)
    monkeypatch.setattr(choose, "_default_k_chunk", lambda spec: spec.chunk_unit)
    packed = loads_from_source(monkeypatch)
    respec.cache_clear()  # (the specs chosen before the change)
    try:
        loads = [tmac.load_model(source, context=64) for _ in range(2)]
    finally:
        respec.cache_clear()
    repacked = [sum(m.repacked for m in model.modules() if isinstance(m, tmac.Linear)) for model in loads]
    assert repacked[0] > 0 and repacked[1] == 0 and not packed  # (mapped both times, not packed from the source)
    assert loads[0].packed_copy == loads[1].packed_copy and len(packed_cache.entries()) == 1
    assert [greedy(model) for model in loads] == [want, want]


@pytest.mark.parametrize("behind", [False, True], ids=["written-first", "written-behind"])
def test_a_failed_write_leaves_nothing_and_the_run_goes_on(cache, source, monkeypatch, behind):
    from tmac.nn import serialize

    def fail(path, tensors, meta):
        with open(path, "wb") as f:
            f.write(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(serialize, "_write_aligned", fail)
    with pytest.warns(UserWarning, match="could not keep a packed copy"):
        model = tmac.load_model(source, context=64, copy_behind=behind)
        packed_cache.wait()
    assert model.packed_copy is None and greedy(model)
    assert os.listdir(cache) == [] or all(not n.endswith(".tmac") and not n.startswith(".") for n in os.listdir(cache))


def test_a_damaged_copy_is_rebuilt_not_trusted(cache, source, monkeypatch):
    want = greedy(tmac.load_model(source, context=64))
    (copy,) = glob.glob(str(cache / "*.tmac"))
    with open(copy, "r+b") as f:  # bytes in the middle of the packed weights
        f.seek(os.path.getsize(copy) // 2)
        f.write(b"\xff" * 4096)
    packed = loads_from_source(monkeypatch)
    with pytest.warns(UserWarning, match="cannot be used"):
        again = tmac.load_model(source, context=64)
    assert len(packed) == 1 and greedy(again) == want
    assert greedy(tmac.load_model(source, context=64)) == want and len(packed) == 1  # the rebuilt copy serves
    with open(copy, "wb") as f:
        f.write(b"not a model")
    with pytest.warns(UserWarning, match="cannot be used"):
        assert greedy(tmac.load_model(source, context=64)) == want


def test_the_cache_keeps_to_its_size(cache, tmp_path, source, monkeypatch):
    tmac.load_model(source, context=64)
    size = packed_cache.entries()[0]["bytes"]
    second = tmp_path / "second.gguf"
    shutil.copyfile(source, second)
    monkeypatch.setenv("TMAC_MODEL_CACHE_GB", str(1.5 * size / 2 ** 30))  # room for one
    tmac.load_model(str(second), context=64)
    assert [e["source"] for e in packed_cache.entries()] == [os.path.realpath(second)]  # the older went
    monkeypatch.setenv("TMAC_MODEL_CACHE_GB", str(0.5 * size / 2 ** 30))  # room for none: nothing written
    shutil.copyfile(source, tmp_path / "third.gguf")
    assert tmac.load_model(str(tmp_path / "third.gguf"), context=64).packed_copy is None


@pytest.mark.slow
def test_tmac_cache_lists_and_clears(tmp_path, source):
    env = dict(os.environ, TMAC_CACHE_DIR=str(tmp_path / "root"), TMAC_MODEL_CACHE="1")
    kernels = os.environ["TMAC_CACHE_DIR"]  # (the suite's compiled kernels, copied: nothing compiles here)
    shutil.copytree(kernels, tmp_path / "root", ignore=shutil.ignore_patterns("*.lock", "models", ".build-*"))

    def tmac_cli(*args):
        r = subprocess.run([sys.executable, "-m", "tmac.apps.cli", *args], capture_output=True, text=True, timeout=600,
                           env=env)
        assert r.returncode == 0, r.stderr
        return r

    runs = [json.loads(tmac_cli("run", source, "-p", "Hi", "-n", "4", "--temperature", "0", "--json").stdout)
            for _ in range(2)]
    assert runs[0]["generated_ids"] == runs[1]["generated_ids"]
    listed = json.loads(tmac_cli("cache", "--json").stdout)
    assert [m["source"] for m in listed["models"]] == [os.path.realpath(source)] and listed["kernels"]
    assert os.path.realpath(source) in tmac_cli("cache").stdout
    assert "removed 1 packed model copy" in tmac_cli("cache", "clear", "--models").stdout
    listed = json.loads(tmac_cli("cache", "--json").stdout)
    assert listed["models"] == [] and listed["kernels"]  # the kernels stay
    tmac_cli("cache", "clear")
    assert json.loads(tmac_cli("cache", "--json").stdout)["kernels"] == []


def test_a_llama_cpp_mix_maps_from_its_copy_as_it_loads(cache, tmp_path, monkeypatch):
    """Q4_K_M (a Q4_K q and k beside a Q6_K v in one fused projection): the copy gives the file's own logits."""
    path = tmp_path / "Q4_K_M.gguf"
    shutil.copyfile(os.path.join(os.path.dirname(__file__), "data", "mixes", "Q4_K_M.gguf"), path)
    prompt = [1, 5, 17, 42, 99, 250]
    direct = tmac.Session(tmac.load_model(str(path), packed_copy=False)).logits(prompt)
    packed = loads_from_source(monkeypatch)
    first = tmac.load_model(str(path))
    second = tmac.load_model(str(path))
    assert second.packed_copy and len(packed) == 1
    for model in (first, second):
        got = tmac.Session(model).logits(prompt)
        assert float((got - direct).abs().max()) <= 1e-5 * float(direct.abs().max())


def test_a_hugging_face_directory_loads_with_the_cache_on(cache, tmp_path):
    """Packed copies are made of GGUF files; a checkpoint directory is loaded as it is (it was once refused as
    "not a regular file" whenever the cache was on, as it is by default)."""
    from families import hf_model

    hf = hf_model("llama")
    hf.save_pretrained(tmp_path / "checkpoint")
    model = tmac.load_model(str(tmp_path / "checkpoint"), context=64, kv_dtype="float32")
    assert model.packed_copy is None and not os.path.exists(cache)
    with torch.no_grad():
        want = hf(torch.tensor([[1, 17, 42, 5, 250, 9]])).logits[0, -1].double()
    got = tmac.Session(model).logits([1, 17, 42, 5, 250, 9])[-1].double()
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())
