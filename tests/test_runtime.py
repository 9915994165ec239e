"""Kernel cache, loading without TVM, kernel directories, threads."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import tmac
from tmac import quantize_weight
from tmac.quant import cache
from tmac.execution import runtime
from tmac.base import reference as ref
from tmac.kernels import best_isa
from tmac.execution.lut_ops import LutWeight
from tmac.quant.choose import spec_for_format

RUN_CACHED = """
import sys, numpy as np, torch
from tmac import quantize_weight
from tmac.execution.lut_ops import LutWeight
qw = quantize_weight(np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32), bits={bits}, group_size=64)
y = LutWeight.from_quantized(qw).matmul(torch.ones(1, 256))
print('tvm' in sys.modules, float(y.sum()))
"""


def _run(code, env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_cached_kernels_run_without_importing_tvm(tmp_path):
    env = dict(os.environ, TMAC_CACHE_DIR=str(tmp_path))
    first = _run(RUN_CACHED.format(bits=3), env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split()[0] == "True" and "compiling kernel" in first.stderr  # a miss compiles (imports TVM)
    second = _run(RUN_CACHED.format(bits=3), env)
    assert second.returncode == 0, second.stderr
    assert second.stdout.split()[0] == "False" and "compiling" not in second.stderr
    assert second.stdout.split()[1] == first.stdout.split()[1]


def _resign(lib: str) -> None:
    """Update a cached library's sidecar to its current bytes, as someone tampering with the cache would."""
    meta = json.load(open(lib[:-3] + ".json"))
    meta.update(sha256=tmac.quant.cache.sha256(lib), bytes=os.path.getsize(lib))
    open(lib[:-3] + ".json", "w").write(json.dumps(meta))


DAMAGE = ["truncated library", "flipped byte", "garbage sidecar", "no sidecar", "truncated, sidecar updated",
          "wrong ELF machine, sidecar updated", "sidecar is a directory", "library is a directory",
          "lock is a directory", "sidecar is a FIFO", "sidecar links to /dev/zero", "sidecar nested 100000 deep"]


@pytest.fixture(scope="module")
def pristine_cache(tmp_path_factory):
    """A kernel cache holding the one kernel ``RUN_CACHED`` at 2 bits compiles (each test damages a copy)."""
    d = tmp_path_factory.mktemp("pristine-cache")
    r = _run(RUN_CACHED.format(bits=2), dict(os.environ, TMAC_CACHE_DIR=str(d)))
    assert r.returncode == 0, r.stderr
    return d


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_cache_entries_are_moved_aside_and_rebuilt(tmp_path, pristine_cache, damage):
    """Whatever state a cache entry is found in, the kernel is rebuilt (one warning) and the next run is clean:
    never a signal, a hang or an error on every run."""
    shutil.copytree(pristine_cache, tmp_path, dirs_exist_ok=True)
    env = dict(os.environ, TMAC_CACHE_DIR=str(tmp_path))
    (lib,) = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".so")]
    meta, lock = lib[:-3] + ".json", lib[:-3] + ".lock"
    data = open(lib, "rb").read()
    if damage.startswith("truncated"):
        open(lib, "wb").write(data[:len(data) // 2])
    elif damage == "flipped byte":
        open(lib, "wb").write(data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1:])
    elif damage.startswith("wrong ELF machine"):
        open(lib, "wb").write(data[:18] + (183 if data[18] == 62 else 62).to_bytes(2, "little") + data[20:])
    elif damage == "garbage sidecar":
        open(meta, "w").write('{"spec": [1, 2')
    elif damage == "no sidecar":
        os.unlink(meta)
    elif damage.endswith("is a directory"):
        path = {"sidecar": meta, "library": lib, "lock": lock}[damage.split()[0]]
        os.unlink(path)
        os.mkdir(path)
    elif damage == "sidecar is a FIFO":
        os.unlink(meta)
        os.mkfifo(meta)
    elif damage == "sidecar links to /dev/zero":
        os.unlink(meta)
        os.symlink("/dev/zero", meta)
    else:
        open(meta, "w").write("[" * 100000 + "]" * 100000)
    if "sidecar updated" in damage:
        _resign(lib)
    again = _run("import warnings; warnings.simplefilter('always')\n" + RUN_CACHED.format(bits=2), env)
    assert again.returncode == 0, again.stderr
    if damage != "lock is a directory":  # (the entry itself was sound)
        assert "compiling kernel" in again.stderr and "moved to" in again.stderr
    assert json.load(open(meta))["sha256"] == tmac.quant.cache.sha256(lib)
    third = _run(RUN_CACHED.format(bits=2), env)
    assert third.returncode == 0 and "compiling" not in third.stderr and "damaged" not in third.stderr, third.stderr


@pytest.mark.slow
@pytest.mark.parametrize("unsafe", ["owned by another user", "world-writable"])
def test_a_cache_others_can_write_is_never_loaded_from(tmp_path, unsafe):
    """A library planted in a cache another user owns or can write (its sidecar matching) is not loaded: kernels go
    to a private directory of this process's, with a warning naming the reason."""
    cache = tmp_path / "cache"
    env = dict(os.environ, TMAC_CACHE_DIR=str(cache))
    assert _run(RUN_CACHED.format(bits=2), env).returncode == 0
    (lib,) = [os.path.join(r, f) for r, _, fs in os.walk(cache) for f in fs if f.endswith(".so")]
    if unsafe == "world-writable":
        os.chmod(os.path.dirname(lib), 0o777)
    else:
        if os.geteuid() != 0:
            pytest.skip("only root can give a directory to another user")  # CI and this machine run as root
        os.chown(os.path.dirname(lib), 12345, 12345)
    r = _run("import warnings; warnings.simplefilter('always')\n" + RUN_CACHED.format(bits=2), env)
    assert r.returncode == 0, r.stderr
    reason = "writable by others" if unsafe == "world-writable" else "owned by uid 12345"
    assert reason in r.stderr and "tmac-kernels-" in r.stderr and "compiling kernel" in r.stderr


@pytest.mark.slow
def test_a_read_only_cache_is_still_read(tmp_path, monkeypatch, rng):
    """Kernels already in a cache this process cannot write are used, not compiled again."""
    cache = tmp_path / "cache"
    env = dict(os.environ, TMAC_CACHE_DIR=str(cache))
    assert _run(RUN_CACHED.format(bits=2), env).returncode == 0
    monkeypatch.setenv("TMAC_CACHE_DIR", str(cache))
    monkeypatch.setattr(runtime, "_loaded", {})  # (not a library this worker loaded from its own cache before)
    real_access = os.access
    monkeypatch.setattr(runtime.os, "access", lambda p, mode: False if str(p).startswith(str(cache)) and
                        mode == os.W_OK else real_access(p, mode))  # root can write anywhere: pretend it cannot
    qw = quantize_weight(np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32), bits=2,
                         group_size=64)
    lib = runtime.load_kernels(LutWeight.from_quantized(qw).spec, best_isa(), progress=True)
    assert lib.path.startswith(str(cache))


def test_invalid_tiling_in_tuning_json_falls_back_to_the_defaults(tmp_path, monkeypatch):
    from tmac.quant import choose
    from tmac.base.formats import WeightFormat

    monkeypatch.setattr(choose, "tuning_file", lambda: str(tmp_path / "tuning.json"))
    isa = best_isa()
    fmt = WeightFormat.rtn(2, 64, False)
    default = spec_for_format(fmt, 256, isa)
    key = choose.key(isa.name, 2, 256, 64, default.lut_group, True)
    (tmp_path / "tuning.json").write_text(json.dumps({key: {"block_rows": 7, "unroll": 3, "n_tile": 2, "k_chunk": 5}}))
    choose._table.cache_clear()
    try:
        with pytest.warns(UserWarning, match="tuning.json: ignoring the tiling"):
            assert spec_for_format(fmt, 256, isa) == default
    finally:
        choose._table.cache_clear()


@pytest.mark.slow
def test_concurrent_processes_compiling_the_same_kernel_both_succeed(tmp_path):
    env = dict(os.environ, TMAC_CACHE_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", RUN_CACHED.format(bits=4)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    assert outs[0][0].split()[1] == outs[1][0].split()[1]
    assert sum("compiling kernel" in o[1] for o in outs) == 1  # the lock let exactly one compile


@pytest.mark.slow
def test_tmac_compile_directory_is_used_by_linear_kernels(tmp_path, rng):
    out = tmp_path / "kernels"
    r = subprocess.run([sys.executable, "-m", "tmac.apps.cli", "compile", "--bits", "2", "--group-size", "64",
                        "--shape", "64x256", "-o", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    manifest = json.load(open(out / "manifest.json"))
    (entry,) = manifest["kernels"]
    assert entry["spec"]["k"] == 256 and entry["isa"] == manifest["isa"] and len(entry["sha256"]) == 64
    qw = quantize_weight(rng.standard_normal((64, 256)).astype(np.float32), bits=2, group_size=64)
    lw = LutWeight.from_quantized(qw, kernel_dir=str(out))
    x = rng.standard_normal((1, 256)).astype(np.float32)
    np.testing.assert_allclose(lw.matmul(torch.from_numpy(x)).numpy(), ref.lut_matmul(x, qw), rtol=1e-4, atol=1e-4)
    assert lw.kernels.path.startswith(str(out))
    # kernels generated by other code (another tmac source: another generator digest) are not used
    stale = tmp_path / "stale"
    shutil.copytree(out, stale)
    entry["generator"] = "0" * 16
    (stale / "manifest.json").write_text(json.dumps({**manifest, "kernels": [entry]}))
    lw = LutWeight.from_quantized(qw, kernel_dir=str(stale))
    np.testing.assert_allclose(lw.matmul(torch.from_numpy(x)).numpy(), ref.lut_matmul(x, qw), rtol=1e-4, atol=1e-4)
    assert lw.kernels.path.startswith(cache.cache_dir())


def test_kernel_cache_key_follows_the_generator_source(tmp_path):
    """The cache key hashes every module codegen imports, found from its import statements: among them the ones a
    hand-written list had left out (the reference, the format table); changing any of them moves
    the key, so kernels compiled by older code are never loaded."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(runtime.__file__))))
    sources = cache.generator_sources()
    names = {os.path.relpath(p, repo) for p in sources}
    assert {"codegen/lut.py", "codegen/glue.py", "codegen/attention.py", "kernels/x86.py", "kernels/arm.py",
            "tmac/quant/spec.py", "tmac/quant/layout.py", "tmac/base/glue.py", "tmac/base/reference.py", "tmac/base/formats.py"} <= names
    assert cache.generator_digest() == cache.source_digest(sources) and cache.cache_dir().endswith(
        cache.generator_digest())
    copies = []
    for i, path in enumerate(sources):  # the same file names, in folders of their own
        (tmp_path / str(i)).mkdir()
        copies.append(shutil.copy(path, tmp_path / str(i) / os.path.basename(path)))
    base = cache.source_digest(copies)
    assert base == cache.generator_digest()
    for copy in copies:
        original = open(copy, "rb").read()
        with open(copy, "ab") as f:
            f.write(b"\n# changed\n")
        assert cache.source_digest(copies) != base, copy
        with open(copy, "wb") as f:
            f.write(original)


def test_the_generator_digest_is_kept_while_its_sources_are_unchanged(tmp_path, monkeypatch):
    """Finding the generator's sources parses them: the digest is kept in the cache with their sizes and times, used
    while they match, found again when they do not or the record is damaged."""
    monkeypatch.setenv("TMAC_CACHE_DIR", str(tmp_path))
    real = cache.generator_sources
    cache.generator_digest.cache_clear()
    try:
        digest = cache.generator_digest()
        record = tmp_path / "generator.json"
        saved = json.loads(record.read_text())
        assert digest == cache.source_digest(real()) and set(real()) <= set(saved["files"])

        def parsed():
            raise AssertionError("the sources were parsed again")
        monkeypatch.setattr(cache, "generator_sources", parsed)
        cache.generator_digest.cache_clear()
        assert cache.generator_digest() == digest  # from the record
        for damage in ({**saved, "stats": [[1, 1]] + saved["stats"][1:]},  # a source changed
                       {**saved, "roots": ["/elsewhere"] + saved["roots"][1:]},  # another copy of tmac
                       {**saved, "files": None}, "["):
            record.write_text(damage if isinstance(damage, str) else json.dumps(damage))
            cache.generator_digest.cache_clear()
            with pytest.raises(AssertionError, match="parsed again"):
                cache.generator_digest()
        record.write_text(json.dumps(saved))  # sound, but writable by others, or in a directory others write
        for path, mode in ((record, 0o666), (tmp_path, 0o777)):
            os.chmod(path, mode)
            cache.generator_digest.cache_clear()
            with pytest.raises(AssertionError, match="parsed again"):
                cache.generator_digest()
            os.chmod(path, 0o600 if path == record else 0o700)
        monkeypatch.setattr(cache, "generator_sources", real)
        cache.generator_digest.cache_clear()
        assert cache.generator_digest() == digest and json.loads(record.read_text())["stats"] == saved["stats"]
    finally:
        cache.generator_digest.cache_clear()


@pytest.mark.slow
def test_cache_key_is_the_same_in_a_checkout_and_an_installed_wheel(tmp_path):
    """Kernels compiled from a checkout (codegen/, kernels/ beside tmac/) serve an installed tmac (tmac/codegen/...)
    of the same source — a cross-compiled kernel directory is used on the device — so the key must not depend on
    the layout."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(runtime.__file__))))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(tmp_path / "dist"), repo], check=True, capture_output=True,
                   timeout=600)
    shutil.rmtree(os.path.join(repo, "build"), ignore_errors=True)
    subprocess.run([*pip, "install", "--no-deps", "--target", str(tmp_path / "site"),
                    *map(str, (tmp_path / "dist").glob("*.whl"))], check=True, capture_output=True, timeout=600)
    code = "import tmac.quant.cache as r; print(r.__file__, r.generator_digest())"
    r = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(tmp_path / "site")))
    where, digest = r.stdout.split()
    assert where.startswith(str(tmp_path / "site")) and digest == cache.generator_digest()


@pytest.mark.slow
def test_kernel_dir_with_tampered_library_is_refused(tmp_path):
    out = tmp_path / "kernels"
    subprocess.run([sys.executable, "-m", "tmac.apps.cli", "compile", "--bits", "2", "--group-size", "64", "--shape",
                    "8x128", "-o", str(out)], check=True, capture_output=True, timeout=600)
    (lib,) = out.glob("*.so")
    good = lib.read_bytes()
    qw = quantize_weight(np.ones((8, 128), np.float32), bits=2, group_size=64)
    lib.write_bytes(good[:-10])
    with pytest.raises(tmac.KernelUnavailableError, match="manifest says"):  # its size, before reading it whole
        LutWeight.from_quantized(qw, kernel_dir=str(out)).matmul(torch.ones(1, 128))
    lib.write_bytes(good[:-10] + b"tampered!!")
    with pytest.raises(tmac.KernelUnavailableError, match="sha256"):
        LutWeight.from_quantized(qw, kernel_dir=str(out)).matmul(torch.ones(1, 128))
    # a library for another machine, listed with its true hash and size, is refused before loading
    manifest = json.load(open(out / "manifest.json"))
    (entry,) = manifest["kernels"]
    lib.write_bytes(good[:18] + (183).to_bytes(2, "little") + good[20:])  # EM_AARCH64
    entry.update(sha256=cache.sha256(str(lib)), bytes=len(good))
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(tmac.KernelUnavailableError, match=f"not a shared object for {best_isa().arch}"):
        LutWeight.from_quantized(qw, kernel_dir=str(out)).matmul(torch.ones(1, 128))
    (out / "manifest.json").write_text('{"kernels": [{"name": ')  # a damaged manifest is refused, not guessed at
    with pytest.raises(tmac.KernelUnavailableError, match="manifest.json"):
        LutWeight.from_quantized(qw, kernel_dir=str(out)).matmul(torch.ones(1, 128))


@pytest.mark.slow
def test_kernel_dir_for_another_arch_warns_once_naming_both(tmp_path, recwarn):
    out = tmp_path / "arm64-kernels"
    subprocess.run([sys.executable, "-m", "tmac.apps.cli", "compile", "--arch", "arm64", "--bits", "2", "--group-size",
                    "64", "--shape", "8x128", "-o", str(out)], check=True, capture_output=True, timeout=600)
    qw = quantize_weight(np.ones((8, 128), np.float32), bits=2, group_size=64)
    for _ in range(2):
        LutWeight.from_quantized(qw, kernel_dir=str(out)).matmul(torch.ones(1, 128))  # compiled for this machine
    isa = best_isa()
    (warning,) = [w for w in recwarn if str(out) in str(w.message)]
    assert "arm64/neon_dotprod" in str(warning.message) and f"{isa.arch}/{isa.name}" in str(warning.message)


def test_no_linker_is_one_clear_message(tmp_path, monkeypatch):
    import importlib.util

    from tmac.codegen import link

    monkeypatch.delenv("TMAC_CC", raising=False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(link.importlib.util, "find_spec",
                        lambda name, *a: None if name == "ziglang" else real_find_spec(name, *a))
    for arch, package in (("arm64", "gcc-aarch64-linux-gnu"), (best_isa().arch, "a C compiler")):
        with pytest.raises(link.LinkerUnavailableError, match=f"pip install ziglang.*{package}"):
            link.find_linker(arch, path=str(tmp_path))
    monkeypatch.setenv("TMAC_CC", "no-such-cc -target x")
    with pytest.raises(link.LinkerUnavailableError, match="TMAC_CC"):
        link.find_linker("arm64", path=str(tmp_path))


def test_threads():
    with pytest.raises(ValueError, match="positive int"):
        tmac.set_num_threads(0)
    with pytest.raises(ValueError, match="positive int"):
        tmac.set_num_threads("2")
    old = tmac.get_num_threads()
    tmac.set_num_threads(1)
    assert tmac.get_num_threads() == 1
    tmac.set_num_threads(old)


@pytest.mark.parametrize("kind", ["w2", "ternary in K chunks"])
def test_two_threads_give_the_same_result(rng, kind):
    """Each thread takes the same row blocks of every K chunk (one parallel launch): 1 and 2 threads agree."""
    m, k = (1024, 512) if kind == "w2" else (1000, 2304)
    w = rng.standard_normal((m, k)).astype(np.float32)
    qw = quantize_weight(w, bits=2, group_size=128) if kind == "w2" else \
        quantize_weight(w, ternary=True, group_size="tensor")
    lw = LutWeight.from_quantized(qw, **({} if kind == "w2" else {"k_chunk": 768}))  # 3 chunks on any ISA
    x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32))
    old = tmac.get_num_threads()
    try:
        tmac.set_num_threads(1)
        one = lw.matmul(x).clone()
        tmac.set_num_threads(2)
        two = lw.matmul(x)
    finally:
        tmac.set_num_threads(old)
    assert torch.equal(one, two)


def _tune(tmp_path, *args):
    """Run `tmac tune ARGS` with a fresh cache: (its environment, its output, the tuning file, its one entry)."""
    env = dict(os.environ, TMAC_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "tmac.apps.cli", "tune", *args], capture_output=True, text=True, env=env,
                       timeout=900)
    assert r.returncode == 0, r.stderr
    (path,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f == "tuning.json"]
    ((key, tiling),) = json.load(open(path)).items()
    return env, r, path, key, tiling


@pytest.mark.slow
def test_tune_persists_and_later_kernels_use_it(tmp_path):
    env, r, path, key, tiling = _tune(tmp_path, "--bits", "2", "--k", "256")
    assert "tuned GEMV ms" in r.stdout and "w2g128" in r.stdout
    assert "_kc128" in r.stderr  # K in two chunks was compiled and timed too
    assert key.endswith("|b2|k256|g128|lg128|z") and set(tiling) == {"block_rows", "unroll", "n_tile", "k_chunk"}
    # (1024 rows: every tuned block size divides them; blocks that do not divide a matrix take half the rows)
    check = ("import numpy as np, tmac; from tmac.execution.lut_ops import LutWeight; "
             "qw = tmac.quantize_weight(np.ones((1024, 256), np.float32), bits=2, group_size=128); "
             "s = LutWeight.from_quantized(qw).spec; print(s.block_rows, s.unroll, s.n_tile, s.k_chunk)")
    used = _run(check, env)
    assert used.returncode == 0, used.stderr
    assert used.stdout.split() == [str(tiling[f]) for f in ("block_rows", "unroll", "n_tile", "k_chunk")]
    json.dump({key: {"block_rows": 256, "unroll": 1, "n_tile": 8}}, open(path, "w"))  # tuned before K chunks
    old = _run(check, env)
    fmt = tmac.quantize_weight(np.ones((1, 256), np.float32), bits=2, group_size=128).format
    chunk = spec_for_format(fmt, 256, best_isa(), block_rows=256, unroll=1, n_tile=8).k_chunk  # the default's
    assert old.returncode == 0 and old.stdout.split() == ["256", "1", "8", str(chunk)], old.stderr
    open(path, "w").write("{not json")  # a damaged tuning file means defaults, not a crash
    again = _run(check, env)
    defaults = _run(check, dict(env, TMAC_CACHE_DIR=str(tmp_path / "untuned")))
    assert again.returncode == 0 and defaults.returncode == 0, again.stderr + defaults.stderr
    assert again.stdout == defaults.stdout


@pytest.mark.slow
def test_tune_covers_ternary_weights(tmp_path):
    """`tmac tune --ternary` times the kernels ternary weights take on this CPU (triples where it has 64-entry
    lookups, 2-bit planes elsewhere: ``uses_triples``) and later ternary specs use the result."""
    from tmac.kernels import best_isa

    triples = best_isa().wide_lookup
    env, r, _, key, tiling = _tune(tmp_path, "--ternary", "--group-size", "tensor", "--k", "384")
    assert "ternary_gtensor" in r.stdout and ("_t3" in r.stderr) == triples  # which kernels were compiled and timed
    assert key.endswith("|b2|k384|g384|lg192|s|t3" if triples else "|b2|k384|g384|lg128|s")
    check = ("import numpy as np, tmac; from tmac.execution.lut_ops import LutWeight; "
             "qw = tmac.quantize_weight(np.ones((1024, 384), np.float32), ternary=True, group_size='tensor'); "
             "s = LutWeight.from_quantized(qw).spec; print(s.triples, s.block_rows, s.unroll, s.n_tile, s.k_chunk)")
    used = _run(check, env)
    assert used.returncode == 0, used.stderr
    assert used.stdout.split() == [str(triples)] + [str(tiling[f]) for f in ("block_rows", "unroll", "n_tile", "k_chunk")]


@pytest.mark.parametrize("confirmed", [True, False])
def test_tune_keeps_the_default_unless_it_loses_in_the_same_pass(tmp_path, monkeypatch, confirmed):
    """The stages time their candidates in separate passes; a winner other than the default is timed against it
    once more, together, and kept only when faster by the margin there. Scripted timings (no kernel runs): the
    first stage makes 64-row blocks 20 % faster; the final pass makes them 10 % faster or 10 % slower."""
    from tmac.quant import choose
    from tmac.nn import tuning
    from tmac.base.formats import WeightFormat

    class Timed:  # stands in for LutWeight: only the spec matters to the scripted timings
        def __init__(self, packed):
            self.spec = packed.spec

        def matmul(self, x):
            pass

    isa = best_isa()
    fmt = WeightFormat.rtn(2, 128, False)
    default = spec_for_format(fmt, 256, isa, unroll=0)
    other = default.block_rows * 2
    passes = []

    def scripted(weights, x):
        passes.append([w.spec for w in weights])
        final = len(passes) == 3  # blocks × unrolls, K chunks, then the default against the winner
        faster = 0.9 if confirmed or not final else 1.1
        return [(0.8 if not final else faster) if w.spec.block_rows == other and w.spec.unroll == default.unroll
                else 1.0 for w in weights]

    monkeypatch.setenv("TMAC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("tmac.execution.lut_ops.LutWeight", Timed)
    monkeypatch.setattr(tuning, "cold_seconds", scripted)
    best, measured = tuning.tune(fmt, 256, isa, m=64)
    assert [s.block_rows for s in passes[2]] == [default.block_rows, other]  # the final pass: default, winner
    kept = passes[2][1] if confirmed else default
    assert (best["block_rows"], best["unroll"], best["k_chunk"]) == (kept.block_rows, kept.unroll, kept.k_chunk)
    assert best["block_rows"] == (other if confirmed else default.block_rows)
    saved = choose.tuned_tiling(isa.name, 2, 256, 128, default.lut_group, True)
    assert saved == best


def _edit_phdr(data: bytes, index: int, field: str, value: int) -> bytes:
    import struct

    phoff = struct.unpack_from("<Q", data, 32)[0]
    at = phoff + 56 * index + {"flags": 4, "vaddr": 16, "memsz": 40}[field]
    width = 4 if field == "flags" else 8
    return data[:at] + value.to_bytes(width, "little") + data[at + width:]


def _phdrs(data: bytes) -> list[tuple]:
    import struct

    phoff, (_, phnum) = struct.unpack_from("<Q", data, 32)[0], struct.unpack_from("<HH", data, 54)
    return [struct.unpack_from("<IIQQQQQQ", data, phoff + 56 * i) for i in range(phnum)]


def test_elf_checks_refuse_what_would_crash_the_loader(tmp_path, monkeypatch, rng):
    """Each edit below passed the sha256 once re-signed and killed the process inside dlopen (SIGSEGV); tmac.base.elf
    refuses it first, naming the file."""
    from tmac.base.elf import check_library
    from tmac.base.errors import KernelUnavailableError

    monkeypatch.setenv("TMAC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(runtime, "_loaded", {})
    qw = quantize_weight(rng.standard_normal((64, 256)).astype(np.float32), bits=2, group_size=64)
    lib = runtime.load_kernels(LutWeight.from_quantized(qw).spec, best_isa(), progress=False)
    data = open(lib.path, "rb").read()
    arch = best_isa().arch
    check_library(lib.path, arch)
    phdrs = _phdrs(data)
    loads = [i for i, p in enumerate(phdrs) if p[0] == 1]
    dynamic = next(i for i, p in enumerate(phdrs) if p[0] == 2)
    edits = {"a segment grown over the next": _edit_phdr(data, loads[1], "memsz", phdrs[loads[1]][6] + (1 << 25)),
             "an unreadable segment": _edit_phdr(data, loads[0], "flags", 0),
             "a writable, executable segment": _edit_phdr(data, loads[1], "flags", 7),
             "the dynamic section moved away": _edit_phdr(data, dynamic, "vaddr", 1 << 40),
             "truncated": data[:len(data) // 2]}
    for bad in edits.values():
        path = tmp_path / "bad.so"
        path.write_bytes(bad)
        with pytest.raises(KernelUnavailableError, match="bad.so"):
            check_library(str(path), arch)
