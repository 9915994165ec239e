"""arm64 kernels: cross-compiled here, run under qemu-aarch64 by our C harness, compared with the reference."""
import os
import shutil
import subprocess

import numpy as np
import pytest

from conftest import rel_l2
from tmac import quantize_weight
from tmac import reference as ref
from tmac.kernels import ISAS
from tmac.packing import pack, spec_for

HARNESS = os.path.join(os.path.dirname(__file__), "..", "tmac", "harness", "run_kernels.c")
TOOLS = {"aarch64-linux-gnu-gcc": "gcc-aarch64-linux-gnu", "qemu-aarch64": "qemu-user"}
PACKAGES = ["gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross", "qemu-user"]


def _ensure_cross_tools():
    missing = [t for t in TOOLS if shutil.which(t) is None] + \
        ([] if os.path.isdir("/usr/aarch64-linux-gnu/include") else ["libc6-dev-arm64-cross"])
    if not missing:
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip(f"missing {missing} and apt-get is unavailable (not root / not Debian): "
                    f"install {' '.join(PACKAGES)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES], check=True, env=env,
                   capture_output=True)


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    _ensure_cross_tools()
    import tvm_ffi.libinfo

    out = str(tmp_path_factory.mktemp("harness") / "run_kernels")
    subprocess.run(["aarch64-linux-gnu-gcc", "-O2", "-rdynamic", "-I", tvm_ffi.libinfo.find_include_path(), HARNESS, "-o", out,
                    "-ldl", "-lpthread"], check=True)
    return out


def _write(d, name, a):
    a.tofile(os.path.join(d, name + ".bin"))
    dt = {np.dtype(np.float32): "float32", np.dtype(np.int8): "int8", np.dtype(np.uint8): "uint8"}[a.dtype]
    return f"{name} {dt} {a.ndim} {' '.join(map(str, a.shape))}"


@pytest.mark.parametrize("isa", ["neon_dotprod", "neon"])
@pytest.mark.parametrize("bits, zeros", [(1, True), (2, True), (3, False), (4, True), (4, False)])
def test_arm64_kernels_under_qemu(harness, tmp_path, rng, isa, bits, zeros):
    from tmac.codegen.build import build_library

    m, k, n = 72, 256, 3
    qw = quantize_weight(rng.standard_normal((m, k)).astype(np.float32), bits=bits, group_size=64,
                         symmetric=not zeros)
    spec = spec_for(qw, ISAS[isa], n_tile=2)
    lib = str(tmp_path / "kern.so")
    build_library(spec, ISAS[isa], lib)
    pw = pack(qw, spec)
    x = rng.standard_normal((n, k)).astype(np.float32)
    rows = spec.padded_rows(n)
    d = str(tmp_path)
    x_line = _write(d, "x", np.vstack([x, np.zeros((rows - n, k), np.float32)]))
    tables = [f"lut int8 3 {rows} {k // 4} 16", f"ls float32 2 {rows} {k // spec.lut_group}",
              f"xs float32 2 {rows} {k // spec.group_size}"]
    weights = [_write(d, "w", pw.weights), _write(d, "s", pw.scales)] + ([_write(d, "z", pw.zeros)] if zeros else [])
    calls = ["build_tables 4", x_line, *tables,
             f"lut_gemm {len(weights) + 4}", *weights, *tables, f"y float32 2 {n} {m}",
             f"lut_gemv {len(weights) + 4}", *weights, *tables, f"y1 float32 2 1 {m}"]
    (tmp_path / "calls.txt").write_text("\n".join(calls) + "\n")
    r = subprocess.run(["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", harness, lib, d], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lut = np.fromfile(os.path.join(d, "lut.out"), np.int8).reshape(rows, k // 4, 16)
    qt, _ = ref.quantize_tables(ref.build_tables(x), spec.lut_group)
    np.testing.assert_array_equal(lut[:n], qt)
    expected = ref.lut_matmul(x, qw)
    y = np.fromfile(os.path.join(d, "y.out"), np.float32).reshape(n, m)
    y1 = np.fromfile(os.path.join(d, "y1.out"), np.float32).reshape(1, m)
    assert rel_l2(y, expected) <= 1e-5
    assert rel_l2(y1[0], expected[0]) <= 1e-5


def test_arm64_argument_check_reaches_the_caller(harness, tmp_path):
    from tmac.codegen.build import build_library

    qw = quantize_weight(np.ones((16, 128), np.float32), bits=2, group_size=64)
    spec = spec_for(qw, ISAS["neon"])
    lib = str(tmp_path / "kern.so")
    build_library(spec, ISAS["neon"], lib)
    (tmp_path / "calls.txt").write_text("build_tables 4\nx float32 2 1 64\nlut int8 3 1 32 16\n"
                                        "ls float32 2 1 2\nxs float32 2 1 2\n")
    r = subprocess.run(["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", harness, lib, str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "shape" in r.stderr
