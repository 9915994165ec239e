"""llama.cpp's llama-bench built as static aarch64 programs, the peer of bench/arm64_counts.py: from the vendored
llama.cpp of the llama-cpp-python sdist tmac's x86 peer is built from, with Debian's aarch64 cross compiler, once
for a Cortex-A76 (armv8.2-a+dotprod: a Raspberry Pi 5) and once for a Cortex-A72 (armv8-a: a Pi 4).

    python bench/arm64/llama_cpp.py [--version 0.3.36] [--out DIR]     # prints CPU=PATH lines for --llama-bench

Needs g++-aarch64-linux-gnu and cmake (installed with apt-get where missing and running as root).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from llama_cpp_tools import DEFAULT_VERSION, cmake_build, ensure_tools, source  # noqa: E402

ARCHS = {"cortex-a76": "armv8.2-a+dotprod", "cortex-a72": "armv8-a"}
TOOLCHAIN = """set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
"""


def build(tree: str, out: str, cpu: str) -> str:
    toolchain = os.path.join(out, "aarch64.cmake")
    with open(toolchain, "w") as f:
        f.write(TOOLCHAIN)
    flags = [f"-DCMAKE_TOOLCHAIN_FILE={toolchain}", "-DGGML_NATIVE=OFF", f"-DGGML_CPU_ARM_ARCH={ARCHS[cpu]}",
             "-DGGML_OPENMP=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
             "-DCMAKE_EXE_LINKER_FLAGS=-static"]
    return cmake_build(tree, os.path.join(out, f"build-{cpu}"), flags, ["llama-bench"])["llama-bench"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--version", default=DEFAULT_VERSION, help="llama-cpp-python's sdist (default: the x86 peer's)")
    p.add_argument("--out", default=os.path.join(os.path.expanduser("~"), ".cache", "tmac-bench", "llama-arm64"))
    p.add_argument("--cpu", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ensure_tools({"aarch64-linux-gnu-g++": "g++-aarch64-linux-gnu", "cmake": "cmake"})
    tree = source(args.version, args.out)
    for cpu in args.cpu:
        print(f"{cpu}={build(tree, args.out, cpu)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
