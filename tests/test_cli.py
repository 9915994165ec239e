import subprocess
import sys


def tmac(*args, **kw):
    return subprocess.run([sys.executable, "-m", "tmac.cli", *args], capture_output=True, text=True, timeout=600, **kw)


def test_info_lists_what_matters():
    r = tmac("info")
    assert r.returncode == 0, r.stderr
    for field in ("architecture", "avx2", "avx512bw", "avx512vnni", "avxvnni", "neon", "dotprod", "kernel ISA",
                  "threads", "torch", "apache-tvm", "apache-tvm-ffi", "kernel cache"):
        assert field in r.stdout


def test_compile_errors_are_one_line():
    for args, needle in [(["compile", "--bits", "2", "--shape", "64x100", "-o", "/tmp/x"], "K=100"),
                         (["compile", "--bits", "2", "--shape", "64by100", "-o", "/tmp/x"], "MxK"),
                         (["compile", "--bits", "2", "--group-size", "48", "--shape", "8x96", "-o", "/tmp/x"],
                          "group_size"),
                         (["compile", "--arch", "arm64", "--isa", "avx2", "--bits", "2", "--shape", "8x64", "-o",
                           "/tmp/x"], "--isa avx2 is for x86_64"),
                         (["compile", "--bits", "2", "--model", "/no/such.gguf", "-o", "/tmp/x"], "not found")]:
        r = tmac(*args)
        assert r.returncode == 1, args
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_compile_arm64_needs_no_arm_machine(tmp_path):
    import shutil

    if shutil.which("aarch64-linux-gnu-gcc") is None:  # test_arm64 installs it; order-independent message check
        r = tmac("compile", "--arch", "arm64", "--bits", "2", "--shape", "64x256", "-o", str(tmp_path))
        assert r.returncode == 1 and "gcc-aarch64-linux-gnu" in r.stderr
        return
    r = tmac("compile", "--arch", "arm64", "--bits", "2", "--shape", "64x256", "-o", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "neon_dotprod" in r.stdout
    lib = next(tmp_path.glob("*.so")).read_bytes()
    assert lib[:4] == b"\x7fELF" and int.from_bytes(lib[18:20], "little") == 183  # EM_AARCH64
