"""arm64 kernels: cross-compiled here, run under qemu-aarch64 by our C harness, compared with the reference."""
import dataclasses
import os
import shutil
import subprocess

import numpy as np
import pytest

from conftest import cross_tools_lock, rel_l2
from tmac import QuantizedWeight, quantize_weight
from tmac.base import reference as ref
from tmac.kernels import ISAS
from tmac.quant.choose import spec_for
from tmac.execution.packing import pack

HARNESS = os.path.join(os.path.dirname(__file__), "..", "tmac", "harness", "run_kernels.c")
TOOLS = {"aarch64-linux-gnu-gcc": "gcc-aarch64-linux-gnu", "qemu-aarch64": "qemu-user"}
PACKAGES = ["gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross", "qemu-user"]


def _ensure_cross_tools():
    with cross_tools_lock():
        missing = [t for t in TOOLS if shutil.which(t) is None] + \
            ([] if os.path.isdir("/usr/aarch64-linux-gnu/include") else ["libc6-dev-arm64-cross"])
        if not missing:
            return
        if shutil.which("apt-get") is None or os.geteuid() != 0:
            pytest.skip(f"missing {missing} and apt-get is unavailable (not root / not Debian): "
                        f"install {' '.join(PACKAGES)}")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES], check=True,
                       env=env, capture_output=True)


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
    dt = {np.dtype(t): t for t in ("float32", "float16", "int8", "uint8")}[a.dtype]
    return f"{name} {dt} {a.ndim} {' '.join(map(str, a.shape))}"


@pytest.mark.parametrize("isa", ["neon_dotprod", pytest.param("neon", marks=pytest.mark.slow)])  # (quick: one)
@pytest.mark.parametrize("bits, zeros, params", [(1, True, "float16"), (2, True, "float16"), (3, False, "float16"),
                                                 (4, True, "float32"), (4, False, "float16"),
                                                 (8, False, "float16"), ("ternary triples", False, "float32"),
                                                 ("Q2_K", True, "super"), ("Q5_K", True, "super"),
                                                 ("Q6_K", False, "super"), ("IQ4_NL", False, "blocks"),
                                                 ("IQ4_XS", False, "super"), ("IQ2_XS", False, "super"),
                                                 ("IQ1_S", True, "super")])
def test_arm64_kernels_under_qemu(harness, tmp_path, rng, isa, bits, zeros, params):
    from tmac.codegen.build import build_library
    from tmac.models.files.synthetic import k_quant_blocks
    from tmac.quant.quantize import import_gguf

    triples = bits == "ternary triples"
    m, k, n = 72, 576 if triples else 256, 3
    w = rng.standard_normal((m, k)).astype(np.float32)
    if triples:
        qw = quantize_weight(w, ternary=True, group_size="row")
    elif params in ("super", "blocks"):  # 4 + 1 (4 + 2) bit planes; byte multipliers (Q6_K: signed, groups of 16) of
        qw = import_gguf(k_quant_blocks(rng, m, k, bits), bits, (m, k))  # super scales; IQ*: codebook tables (IQ2_XS: groups of 16)
    else:
        qw = quantize_weight(w, bits=bits, group_size=64, symmetric=not zeros)
        fmt = dataclasses.replace(qw.format, scale_dtype=params, zero_dtype=params)
        qw = QuantizedWeight(qw.codes, qw.scales, qw.zeros, fmt)
    chunks = {} if params == "super" else {"k_chunk": 384 if triples else 128}  # K chunks (triples: a shorter last)
    spec = spec_for(qw, ISAS[isa], n_tile=2, **chunks, **({"triples": True} if triples else {}))  # NEON: planes
    assert spec.triples == triples and bool(spec.super_groups) == (params == "super")
    assert bool(spec.codebook) == (str(bits).startswith("IQ") and bits != "IQ1_S")  # (IQ1_S: a K-quant of 2 bits)
    assert spec.k_chunk < spec.k_padded or params == "super"
    lib = str(tmp_path / "kern.so")
    build_library(spec, ISAS[isa], lib)
    pw = pack(qw, spec)
    x = rng.standard_normal((n, k)).astype(np.float32)
    rows = spec.padded_rows(n)
    d = str(tmp_path)
    x_line = _write(d, "x", np.vstack([x, np.zeros((rows - n, k), np.float32)]))
    shapes = spec.table_shapes(rows)

    def tables_of(names, shapes):
        return [f"{name} {dt} {len(shape)} {' '.join(map(str, shape))}"
                for name, dt, shape in zip(names, ("int8", "float32", "float32"), shapes)]

    tables, tables1 = tables_of(("lut", "ls", "xs"), shapes), tables_of(("lut1", "ls1", "xs1"), spec.table_shapes(1))
    weights = [_write(d, "w", pw.weights), _write(d, "s", pw.scales)] + ([_write(d, "z", pw.zeros)] if zeros else [])
    calls = ["build_tables 4", x_line, *tables,
             f"lut_gemm {len(weights) + 4}", *weights, *tables, f"y float32 2 {n} {m}",
             f"lut_gemv {len(weights) + 5}", _write(d, "x1", x[:1]), *weights, *tables1, f"y1 float32 2 1 {m}"]
    (tmp_path / "calls.txt").write_text("\n".join(calls) + "\n")
    r = subprocess.run(["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", harness, lib, d], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lut = np.fromfile(os.path.join(d, "lut.out"), np.int8).reshape(shapes[0])
    if triples:
        qt, _ = ref.quantize_tables(ref.build_triple_tables(x, spec.k_padded), spec.lut_group, per_table=3)
        expected = ref.lut_matmul_triples(x, qw)
    elif qw.format.codebook:
        qt, _ = ref.quantize_tables(ref.build_codebook_tables(x, qw.format.codebook), spec.lut_group, per_table=1)
        expected = ref.lut_matmul(x, qw)
    else:
        qt, _ = ref.quantize_tables(ref.build_tables(x), spec.lut_group)
        expected = ref.lut_matmul(x, qw)
    np.testing.assert_array_equal(lut[:n], qt)
    y = np.fromfile(os.path.join(d, "y.out"), np.float32).reshape(n, m)
    y1 = np.fromfile(os.path.join(d, "y1.out"), np.float32).reshape(1, m)
    assert rel_l2(y, expected) <= 1e-5
    assert rel_l2(y1[0], expected[0]) <= 1e-5


@pytest.mark.parametrize("kind", ["Q4_0", "w4g32", "w5g64-sym", "Q4_K", "Q6_K", "Q3_K", "IQ4_NL", "IQ4_XS", "IQ2_XS"])
def test_arm64_dot_products_under_qemu(harness, tmp_path, rng, kind):
    """A prompt's dot products on a Cortex-A76 (``sdot``; codes of formats without zeros less their offset, an
    i-quant's codes as its levels): the int8 activations bit for bit the reference's, the GEMM its oracle's, with
    the weights in NEON's K chunks (a shorter last one), a partial last row block and a partial last tile of
    activation rows."""
    import gguf

    from tmac.codegen.build import build_library
    from tmac.execution.lut_ops import dot_buffers, dot_padded_rows
    from tmac.models.files.synthetic import k_quant_blocks
    from tmac.quant.quantize import import_gguf

    m, k, n = 72, 768, 5
    if kind.endswith("_K") or kind.startswith("IQ"):
        qw = import_gguf(k_quant_blocks(rng, m, k, kind), kind, (m, k))
    elif kind == "Q4_0":
        w = (rng.standard_normal((m, k)) * 0.02).astype(np.float32)
        qw = import_gguf(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0), kind, (m, k))
    else:
        bits, group = kind.split("-")[0][1:].split("g")
        qw = quantize_weight(rng.standard_normal((m, k)).astype(np.float32), bits=int(bits), group_size=int(group),
                             symmetric=kind.endswith("-sym"))
    spec = spec_for(qw, ISAS["neon_dotprod"], k_chunk=512 if qw.format.super_group else 320)
    assert spec.dot_products and spec.k_chunk < spec.k_padded
    lib = str(tmp_path / "kern.so")
    build_library(spec, ISAS["neon_dotprod"], lib)
    pw = pack(qw, spec)
    x = rng.standard_normal((n, k)).astype(np.float32)
    rows = dot_padded_rows(spec, n)
    d = str(tmp_path)
    bufs = [f"{name} {dt} 2 {' '.join(map(str, t.shape))}"
            for name, dt, t in zip(("xq", "xd", "xs"), ("int8", "float32", "float32"), dot_buffers(spec, rows))]
    weights = [_write(d, "w", pw.weights), _write(d, "s", pw.scales)] + \
        ([_write(d, "z", pw.zeros)] if pw.zeros is not None else [])
    calls = ["quantize_rows 4", _write(d, "x", np.vstack([x, np.zeros((rows - n, k), np.float32)])), *bufs,
             f"dot_gemm {len(weights) + 4}", *weights, *bufs, f"y float32 2 {n} {m}"]
    (tmp_path / "calls.txt").write_text("\n".join(calls) + "\n")
    r = subprocess.run(["qemu-aarch64", "-cpu", "cortex-a76", "-L", "/usr/aarch64-linux-gnu", harness, lib, d],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    block = spec.activation_block
    want_q, want_d = ref.quantize_activations(x, block)
    np.testing.assert_array_equal(np.fromfile(os.path.join(d, "xq.out"), np.int8).reshape(rows, k)[:n], want_q)
    np.testing.assert_array_equal(np.fromfile(os.path.join(d, "xd.out"), np.float32).reshape(rows, -1)[:n], want_d)
    y = np.fromfile(os.path.join(d, "y.out"), np.float32).reshape(n, m)
    assert rel_l2(y, ref.dot_matmul(x, qw, block)) <= 1e-5


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


@pytest.mark.parametrize("isa", ["neon_dotprod", "neon"])
def test_arm64_decode_glue_under_qemu(harness, tmp_path, rng, isa):
    """The decode glue for arm64 (norms, attention over the cache, activation, int8 quantization), against the
    float64 statements of test_decode."""
    from test_decode import _attend_ref, _key_blocks, _keys_of_blocks, _quantize_ref, _rms_ref

    from tmac.codegen.build import build_library
    from tmac.base.glue import GlueSpec

    dim, h, kv, hd, ffn, ctx, pos = 96, 6, 2, 20, 80, 10, 6  # head_dim 20: vectors of 2 and 4 lanes as well
    spec = GlueSpec(isa, dim, h, kv, hd, ffn, "silu", True, True)
    lib = str(tmp_path / "glue.so")
    build_library(spec, ISAS[isa], lib)
    d = str(tmp_path)
    x, delta, w = (rng.standard_normal((1, dim)).astype(np.float32) for _ in range(3))
    qkv = rng.standard_normal((1, (h + 2 * kv) * hd)).astype(np.float32)
    angles = rng.uniform(0, 6, (ctx, 1, hd // 2))
    cos, sin = (f(np.concatenate([angles, angles], -1)).astype(np.float32) for f in (np.cos, np.sin))
    ck, cv = rng.standard_normal((2, kv, 16, hd)).astype(np.float16)  # the float16 cache: positions in blocks of 16
    gu = rng.standard_normal((1, 2 * ffn)).astype(np.float32)
    calls = ["norm_in 5", _write(d, "x", x), _write(d, "delta", delta), _write(d, "w", w[0]), "=f 1e-5",
             f"xn float32 2 1 {dim}",
             "attend 8", _write(d, "qkv", qkv), _write(d, "cos", cos), _write(d, "sin", sin), _write(d, "ck", _key_blocks(ck)),
             _write(d, "cv", cv), f"sc float32 2 {h} 16", f"=i {pos}", f"att float32 2 1 {h * hd}",
             "gated_act 2", _write(d, "gu", gu), f"hid float32 2 1 {ffn}",
             "quantize_q 1", f"att float32 2 1 {h * hd}"]
    (tmp_path / "calls.txt").write_text("\n".join(calls) + "\n")
    r = subprocess.run(["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", harness, lib, d], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr

    def out(name, shape, dtype=np.float32):
        return np.fromfile(os.path.join(d, name + ".out"), dtype).reshape(shape)

    x64 = x.astype(np.float64) + delta
    np.testing.assert_allclose(out("xn", (1, dim)), _rms_ref(x64, w[0], 1e-5), rtol=1e-5, atol=1e-6)
    att, ref_k, ref_v = _attend_ref(qkv, cos, sin, ck, cv, pos, h, kv, hd)
    keys = _keys_of_blocks(out("ck", (kv, 1, hd, 16), np.float16), 16)
    np.testing.assert_allclose(keys, ref_k, rtol=1e-3, atol=1e-6)  # float32 and float64 rotations, rounded
    np.testing.assert_array_equal(out("cv", cv.shape, np.float16), ref_v)
    q = _quantize_ref(att)
    got = out("att", (1, h * hd))
    assert np.abs(got - q).max() <= np.abs(q).max() / 127 * 1.001 and np.mean(np.abs(got - q) < 1e-5) > 0.98
    g = gu.astype(np.float64)
    np.testing.assert_allclose(out("hid", (1, ffn)), g[:, :ffn] / (1 + np.exp(-g[:, :ffn])) * g[:, ffn:], rtol=2e-6,
                               atol=1e-6)
