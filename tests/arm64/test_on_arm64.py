"""The whole runtime on arm64: Python, torch, tvm-ffi, the kernel loader, the decode plan and the CLI, run as
aarch64 code under ``qemu-aarch64`` for a Raspberry Pi 5's CPU (Cortex-A76: NEON + dotprod) and a Pi 4's
(Cortex-A72: NEON only). ``make test-arm64`` builds the environment (``environment.py``) and runs these.

qemu-user cannot start an aarch64 child process (that would need binfmt), so where the device itself compiles
kernels, TVM's aarch64 wheel generates the code inside the emulated process and only the final link runs on the
host, through ``TMAC_CC`` (the ziglang wheel, linking for aarch64).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import environment

CPUS = {"cortex-a76": "neon_dotprod", "cortex-a72": "neon"}
PROMPT = "The capital of France is"
RUN = ["run", "--ignore-eos", "-n", "16", "-p", PROMPT, "--json", "--temperature", "0"]
HOST_LINKER = f"{sys.executable} -m ziglang cc -target aarch64-linux-gnu"
NO_COMPILERS = {"PATH": os.path.join(environment.ROOT, "usr", "bin")}  # aarch64 programs: none can run here


def arm64(cpu: str, args: list[str], env: dict | None = None, timeout: int = 1800) -> subprocess.CompletedProcess:
    cmd = environment.qemu_python(cpu) + args
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **NO_COMPILERS, **(env or {})})
    assert r.returncode == 0, f"{' '.join(args)} on {cpu} exited {r.returncode}:\n{r.stderr[-4000:]}"
    return r


@pytest.fixture
def report(record_property):
    """Lines for the summary `make test-arm64` prints at the end (xdist workers' own output is not shown)."""
    return lambda text: record_property("arm64", text)


@pytest.fixture(scope="session")
def x86_run(tmp_path_factory):
    r = subprocess.run([sys.executable, "-m", "tmac.apps.cli", *RUN], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "TMAC_CACHE_DIR": str(tmp_path_factory.mktemp("x86-cache"))})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="session")
def x86_logits():
    """The last position's logits as `tmac run` computes them on x86-64: through the prefill plan, which gives a
    token-by-token decode's logits (not the eager forward of ``Session.logits``, which rounds otherwise and can order
    a near-tie the other way)."""
    import torch

    import tmac
    from tmac.models.run.decode import Plans
    from tmac.models.run.generate import prefill
    from tmac.models.run.sequence import Sequence

    model = tmac.load_model()

    def last(ids):
        with torch.inference_mode():
            *_, (_, logits) = prefill(model, ids, Sequence(model), last_only=True, plans=Plans(model).current())
        return logits[-1]
    return last


def _same_as_x86(report, cpu: str, how: str, got: dict, x86: dict, x86_logits) -> None:
    """The arm64 ids equal the x86-64 ones, or part at a near-tie: a step where x86-64's own logits put the two
    tokens first and second, within 1 % of their range of each other (the two ISAs' float code rounds differently;
    at a tie within a thousandth the x86-64 prefill's logits, in a busy test worker, can order the pair either way)."""
    text = (f"{cpu} ({CPUS[cpu]}), {how}: {got['text']!r}\n  arm64  ids {got['generated_ids']}\n"
            f"  x86-64 ids {x86['generated_ids']}\n  {got['gen_tokens_per_s']:.2f} tok/s under emulation "
            f"({1 / got['gen_tokens_per_s']:.2f} s a token), setup {got['setup_s']:.1f} s")
    assert got["prompt_ids"] == x86["prompt_ids"]
    ours, theirs = got["generated_ids"], x86["generated_ids"]
    assert len(ours) == len(theirs) == 16
    step = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if step is None:
        report(text + "\n  the same ids")
        return
    logits = x86_logits(x86["prompt_ids"] + theirs[:step])
    first, second = logits.topk(2).indices.tolist()
    margin = float(logits[theirs[step]] - logits[ours[step]])
    report(text + f"\n  parted at step {step}, a near-tie: x86-64's logits give {theirs[step]} "
                  f"{float(logits[theirs[step]]):.3f} and {ours[step]} {float(logits[ours[step]]):.3f} (margin "
                  f"{margin:.3f}, range {float(logits.max() - logits.min()):.1f})")
    assert {first, second} == {theirs[step], ours[step]}
    assert abs(margin) <= 0.01 * float(logits.max() - logits.min())


@pytest.mark.parametrize("cpu", CPUS)
def test_info_names_the_arm64_isa(cpu, report):
    out = arm64(cpu, ["-m", "tmac.apps.cli", "info"]).stdout
    rows = {line[:16].strip(): line[16:].strip() for line in out.splitlines()}  # `tmac info`'s two columns
    report(f"{cpu}: tmac info: architecture {rows['architecture']}, kernel ISA {rows['kernel ISA']}")
    assert rows["architecture"] == "arm64"
    assert rows["kernel ISA"].split()[0] == CPUS[cpu]


@pytest.mark.parametrize("cpu", CPUS)
def test_run_with_kernels_cross_compiled_on_x86(cpu, tmp_path, x86_run, x86_logits, report):
    kernels = tmp_path / "kernels"
    compiled = subprocess.run([sys.executable, "-m", "tmac.apps.cli", "compile", "--arch", "aarch64", "--isa", CPUS[cpu],
                               "-o", str(kernels)], capture_output=True, text=True, timeout=900)
    assert compiled.returncode == 0, compiled.stderr
    r = arm64(cpu, ["-m", "tmac.apps.cli", *RUN],
              {"TMAC_KERNEL_DIR": str(kernels), "TMAC_CACHE_DIR": str(tmp_path / "cache")})
    assert "compiling kernel" not in r.stderr  # every kernel came from the directory
    _same_as_x86(report, cpu, "kernels cross-compiled on x86-64", json.loads(r.stdout), x86_run, x86_logits)


@pytest.mark.parametrize("cpu", CPUS)
def test_run_compiling_kernels_on_the_device(cpu, tmp_path, x86_run, x86_logits, report):
    r = arm64(cpu, ["-m", "tmac.apps.cli", *RUN], {"TMAC_CACHE_DIR": str(tmp_path / "cache"), "TMAC_CC": HOST_LINKER})
    assert f"for {CPUS[cpu]} ..." in r.stderr  # compiled here, by apache-tvm's aarch64 wheel
    _same_as_x86(report, cpu, "kernels compiled on the device", json.loads(r.stdout), x86_run, x86_logits)


LINEAR_CHECK = """
import json, sys
import numpy as np, torch, tmac
from tmac.base import reference as ref
rng = np.random.default_rng(0)
x = rng.standard_normal((3, 256)).astype(np.float32)
w = rng.standard_normal((96, 256)).astype(np.float32)
out = {}
for name, kw in (("W1", dict(bits=1, group_size=64)), ("W2", dict(bits=2, group_size=64)),
                 ("W4", dict(bits=4, group_size=32)), ("ternary", dict(ternary=True, group_size=64))):
    qw = tmac.quantize_weight(w, **kw)
    lin = tmac.Linear.from_quantized(qw)
    with torch.inference_mode():
        y = lin(torch.from_numpy(x)).numpy()        # GEMM: 3 rows
        y1 = lin(torch.from_numpy(x[:1])).numpy()   # GEMV: 1 row
    out[name] = dict(isa=lin.spec.isa, y=y.tolist(), y1=y1.tolist(), lut=ref.lut_matmul(x, qw).tolist(),
                     dequantized=qw.dequantize().tolist())
json.dump(out, sys.stdout)
"""


@pytest.mark.parametrize("cpu", CPUS)
def test_linear_against_the_numpy_reference(cpu, tmp_path, report):
    r = arm64(cpu, ["-c", LINEAR_CHECK], {"TMAC_CACHE_DIR": str(tmp_path / "cache"), "TMAC_CC": HOST_LINKER})
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    for name, got in json.loads(r.stdout).items():
        assert got["isa"] == CPUS[cpu]
        y, y1, lut = (np.array(got[k]) for k in ("y", "y1", "lut"))
        exact = x.astype(np.float64) @ np.array(got["dequantized"]).T  # fp64, the quantized weights themselves
        lut_err = np.linalg.norm(y - lut) / np.linalg.norm(lut)
        exact_err = np.linalg.norm(y - exact) / np.linalg.norm(exact)
        report(f"{cpu}: tmac.Linear {name}: rel. L2 {lut_err:.1e} vs the numpy LUT reference, {exact_err:.1e} vs "
               f"fp64 on the quantized weights")
        assert lut_err <= 1e-5 and np.linalg.norm(y1[0] - lut[0]) / np.linalg.norm(lut[0]) <= 1e-5
        assert exact_err <= 0.02  # int8 activation tables: about 1 % (the reference's own error)


MIX_CHECK = """
import json, sys, warnings
import tmac
warnings.filterwarnings("error", message=".*packed for")  # a repack: the file must load as packed, for this CPU
model = tmac.load_model(sys.argv[1], kv_dtype="float32", progress=False)
logits = tmac.Session(model).logits(json.loads(sys.argv[2]))
json.dump({"isas": sorted({m.spec.isa for m in model.modules() if isinstance(m, tmac.Linear)}),
           "logits": logits.tolist()}, sys.stdout)
"""


@pytest.mark.parametrize("cpu", CPUS)
def test_a_llama_cpp_q4_k_m_mix_packed_on_x86_matches_llama_cpp(cpu, tmp_path, report):
    """llama.cpp's own Q4_K_M mix (Q4_K q and k beside a Q6_K v in one fused projection, a Q6_K head), converted
    for the Pi's CPU on x86-64 (`tmac convert --isa`) with its kernels (`tmac compile --model`): on arm64 it maps
    without a repack or a compile, and its logits meet the bounds x86-64's do against llama.cpp's logits and the
    exact model (tests/test_mixes.py)."""
    from llama_fp64 import llama_logits

    data = os.path.join(os.path.dirname(__file__), "..", "data")
    reference = json.load(open(os.path.join(data, "mixes.json")))
    source = os.path.join(data, "mixes", "Q4_K_M.gguf")
    packed, kernels = str(tmp_path / "mix.tmac"), str(tmp_path / "kernels")
    for args in (["convert", source, "--isa", CPUS[cpu], "-o", packed],
                 ["compile", "--isa", CPUS[cpu], "--model", packed, "-o", kernels]):
        done = subprocess.run([sys.executable, "-m", "tmac.apps.cli", *args], capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, done.stderr
    r = arm64(cpu, ["-c", MIX_CHECK, packed, json.dumps(reference["prompt"])],
              {"TMAC_KERNEL_DIR": kernels, "TMAC_CACHE_DIR": str(tmp_path / "cache")})
    assert "compiling kernel" not in r.stderr
    out = json.loads(r.stdout)
    assert out["isas"] == [CPUS[cpu]]
    got = np.array(out["logits"], np.float64)
    want = np.array(reference["files"]["Q4_K_M"]["logits"], np.float64)
    exact = llama_logits(source, reference["prompt"])

    def relative(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))
    ours, theirs = relative(got, exact), relative(want, exact)
    report(f"{cpu}: llama.cpp's Q4_K_M mix packed on x86-64: rel. L2 to float64 logits tmac {ours:.4f}, llama.cpp "
           f"{theirs:.4f}; tmac to llama.cpp {relative(got, want):.4f}")
    assert ours <= 2.5 * theirs and relative(got, want) <= 0.04
