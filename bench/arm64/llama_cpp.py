"""llama.cpp's llama-bench built as static aarch64 programs, the peer of bench/arm64_counts.py: from the vendored
llama.cpp of the llama-cpp-python sdist tmac's x86 peer is built from, with Debian's aarch64 cross compiler, once
for a Cortex-A76 (armv8.2-a+dotprod: a Raspberry Pi 5) and once for a Cortex-A72 (armv8-a: a Pi 4).

    python bench/arm64/llama_cpp.py [--version 0.3.36] [--out DIR]     # prints CPU=PATH lines for --llama-bench

Needs g++-aarch64-linux-gnu and cmake (installed with apt-get where missing and running as root).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tarfile

ARCHS = {"cortex-a76": "armv8.2-a+dotprod", "cortex-a72": "armv8-a"}
TOOLCHAIN = """set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
"""


def ensure_tools() -> None:
    missing = [t for t in ("aarch64-linux-gnu-g++", "cmake") if shutil.which(t) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise SystemExit(f"missing {', '.join(missing)}: apt-get install g++-aarch64-linux-gnu cmake")
    subprocess.run(["apt-get", "update", "-qq"], check=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "g++-aarch64-linux-gnu", "cmake"], check=True)


def source(version: str, out: str) -> str:
    tree = os.path.join(out, f"llama_cpp_python-{version}", "vendor", "llama.cpp")
    if os.path.isdir(tree):
        return tree
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={version}", "-d", out], check=True)
    (archive,) = glob.glob(os.path.join(out, f"llama_cpp_python-{version}.tar.gz"))
    with tarfile.open(archive) as t:
        t.extractall(out, filter="data")
    return tree


def build(tree: str, out: str, cpu: str) -> str:
    build_dir = os.path.join(out, f"build-{cpu}")
    program = os.path.join(build_dir, "bin", "llama-bench")
    if os.path.exists(program):
        return program
    toolchain = os.path.join(out, "aarch64.cmake")
    with open(toolchain, "w") as f:
        f.write(TOOLCHAIN)
    subprocess.run(["cmake", "-S", tree, "-B", build_dir, f"-DCMAKE_TOOLCHAIN_FILE={toolchain}",
                    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", f"-DGGML_CPU_ARM_ARCH={ARCHS[cpu]}",
                    "-DGGML_OPENMP=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DCMAKE_EXE_LINKER_FLAGS=-static"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", build_dir, "--target", "llama-bench", f"-j{os.cpu_count() or 1}"],
                   check=True, stdout=subprocess.DEVNULL)
    return program


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--version", default="0.3.36", help="llama-cpp-python's sdist (default: the x86 peer's)")
    p.add_argument("--out", default=os.path.join(os.path.expanduser("~"), ".cache", "tmac-bench", "llama-arm64"))
    p.add_argument("--cpu", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ensure_tools()
    tree = source(args.version, args.out)
    for cpu in args.cpu:
        print(f"{cpu}={build(tree, args.out, cpu)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
