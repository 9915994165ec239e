"""Kernel cache, loading without TVM, kernel directories, threads."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import tmac
from tmac import quantize_weight
from tmac import reference as ref
from tmac.lut_ops import LutWeight

RUN_CACHED = """
import sys, numpy as np, torch
from tmac import quantize_weight
from tmac.lut_ops import LutWeight
qw = quantize_weight(np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32), bits={bits}, group_size=64)
y = LutWeight.from_quantized(qw).matmul(torch.ones(1, 256))
print('tvm' in sys.modules, float(y.sum()))
"""


def _run(code, env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)


def test_cached_kernels_run_without_importing_tvm(tmp_path):
    env = dict(os.environ, TMAC_CACHE_DIR=str(tmp_path))
    first = _run(RUN_CACHED.format(bits=3), env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split()[0] == "True" and "compiling kernel" in first.stderr  # a miss compiles (imports TVM)
    second = _run(RUN_CACHED.format(bits=3), env)
    assert second.returncode == 0, second.stderr
    assert second.stdout.split()[0] == "False" and "compiling" not in second.stderr
    assert second.stdout.split()[1] == first.stdout.split()[1]


@pytest.mark.parametrize("damage", ["truncated library", "flipped byte", "garbage sidecar", "no sidecar"])
def test_corrupted_cached_library_is_rebuilt_not_loaded(tmp_path, damage):
    env = dict(os.environ, TMAC_CACHE_DIR=str(tmp_path))
    assert _run(RUN_CACHED.format(bits=2), env).returncode == 0
    (lib,) = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".so")]
    if damage == "truncated library":
        with open(lib, "r+b") as f:
            f.truncate(1000)
    elif damage == "flipped byte":
        data = bytearray(open(lib, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(lib, "wb").write(bytes(data))
    elif damage == "garbage sidecar":
        open(lib[:-3] + ".json", "w").write('{"spec": [1, 2')
    else:
        os.unlink(lib[:-3] + ".json")
    again = _run(RUN_CACHED.format(bits=2), env)
    assert again.returncode == 0, again.stderr
    assert "compiling kernel" in again.stderr
    meta = json.load(open(lib[:-3] + ".json"))
    assert meta["sha256"] == tmac.runtime.sha256(lib)


def test_concurrent_processes_compiling_the_same_kernel_both_succeed(tmp_path):
    env = dict(os.environ, TMAC_CACHE_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", RUN_CACHED.format(bits=4)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    assert outs[0][0].split()[1] == outs[1][0].split()[1]
    assert sum("compiling kernel" in o[1] for o in outs) == 1  # the lock let exactly one compile


def test_read_only_cache_falls_back_with_a_warning(tmp_path):
    if os.geteuid() == 0:
        ro = "/proc/tmac-not-writable"  # root ignores permission bits; /proc is never writable
    else:
        ro = str(tmp_path / "ro")
        os.makedirs(ro)
        os.chmod(ro, 0o500)
    env = dict(os.environ, TMAC_CACHE_DIR=ro, TMPDIR=str(tmp_path))
    r = _run("import warnings; warnings.simplefilter('always')\n" + RUN_CACHED.format(bits=2), env)
    assert r.returncode == 0, r.stderr
    assert "not writable" in r.stderr


def test_tmac_compile_directory_is_used_by_linear_kernels(tmp_path, rng):
    out = tmp_path / "kernels"
    r = subprocess.run([sys.executable, "-m", "tmac.cli", "compile", "--bits", "2", "--group-size", "64",
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


def test_kernel_dir_with_tampered_library_is_refused(tmp_path):
    out = tmp_path / "kernels"
    subprocess.run([sys.executable, "-m", "tmac.cli", "compile", "--bits", "2", "--group-size", "64", "--shape",
                    "8x128", "-o", str(out)], check=True, capture_output=True, timeout=600)
    (lib,) = out.glob("*.so")
    lib.write_bytes(lib.read_bytes()[:-10])
    qw = quantize_weight(np.ones((8, 128), np.float32), bits=2, group_size=64)
    with pytest.raises(tmac.KernelUnavailableError, match="sha256"):
        LutWeight.from_quantized(qw, kernel_dir=str(out)).matmul(torch.ones(1, 128))
    (out / "manifest.json").write_text('{"kernels": [{"name": ')  # a damaged manifest is refused, not guessed at
    with pytest.raises(tmac.KernelUnavailableError, match="manifest.json"):
        LutWeight.from_quantized(qw, kernel_dir=str(out)).matmul(torch.ones(1, 128))


def test_threads():
    with pytest.raises(ValueError, match="positive int"):
        tmac.set_num_threads(0)
    with pytest.raises(ValueError, match="positive int"):
        tmac.set_num_threads("2")
    old = tmac.get_num_threads()
    tmac.set_num_threads(1)
    assert tmac.get_num_threads() == 1
    tmac.set_num_threads(old)


def test_two_threads_give_the_same_result(rng):
    qw = quantize_weight(rng.standard_normal((1024, 512)).astype(np.float32), bits=2, group_size=128)
    lw = LutWeight.from_quantized(qw)
    x = torch.from_numpy(rng.standard_normal((3, 512)).astype(np.float32))
    old = tmac.get_num_threads()
    try:
        tmac.set_num_threads(1)
        one = lw.matmul(x).clone()
        tmac.set_num_threads(2)
        two = lw.matmul(x)
    finally:
        tmac.set_num_threads(old)
    assert torch.equal(one, two)


def test_tune_persists_and_later_kernels_use_it(tmp_path):
    env = dict(os.environ, TMAC_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "tmac.cli", "tune", "--bits", "2", "--k", "256"], capture_output=True,
                       text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr
    assert "tuned GEMV ms" in r.stdout and "w2g128" in r.stdout
    (path,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f == "tuning.json"]
    ((key, tiling),) = json.load(open(path)).items()
    assert key.endswith("|b2|k256|g128|lg128|z") and set(tiling) == {"block_rows", "unroll", "n_tile"}
    check = ("import numpy as np, tmac; from tmac.lut_ops import LutWeight; "
             "qw = tmac.quantize_weight(np.ones((64, 256), np.float32), bits=2, group_size=128); "
             "s = LutWeight.from_quantized(qw).spec; print(s.block_rows, s.unroll, s.n_tile)")
    used = _run(check, env)
    assert used.returncode == 0, used.stderr
    assert used.stdout.split() == [str(tiling["block_rows"]), str(tiling["unroll"]), str(tiling["n_tile"])]
    open(path, "w").write("{not json")  # a damaged tuning file means defaults, not a crash
    again = _run(check, env)
    assert again.returncode == 0 and again.stdout.split()[1:] == ["8", "2"], again.stderr  # defaults: unroll 8, n_tile 2
