"""llama.cpp's own programs for this machine, bench-only: ``llama-server`` (continuous batching, the serving anchor of
``bench/serve_load.py --peer``), ``llama-bench`` and ``llama-quantize``, built from the vendored llama.cpp of the
llama-cpp-python sdist the ``peer`` extra installs, with the same CPU flags (each x86 extension ON only where the
CPU has it, AMX OFF: docs/llama-cpp.md). Never in the test path.

    python bench/llama_cpp_tools.py [--version 0.3.36] [--out DIR] [--isa avx2] [--targets llama-server ...]

prints ``NAME=PATH`` for each program. ``libllama`` is the shared library llama-cpp-python loads, built for the same
flags; its folder, as ``LLAMA_CPP_LIB_PATH``, makes ``tmac bench --e2e``'s peer that build (with ``--isa avx2``:
llama.cpp as an AVX2-only CPU runs it). Needs cmake and a C++ compiler (installed with apt-get where missing and
running as root). A second call finds the programs built and prints them at once.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile

DEFAULT_VERSION = "0.3.36"
TARGETS = ("llama-server", "llama-bench", "llama-quantize", "libllama")


def ensure_tools(programs: dict[str, str]) -> None:
    """``programs``: a program → the Debian package that has it."""
    missing = [pkg for prog, pkg in programs.items() if shutil.which(prog) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise SystemExit(f"missing programs: apt-get install {' '.join(missing)}")
    subprocess.run(["apt-get", "update", "-qq"], check=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True)


def source(version: str, out: str) -> str:
    """The vendored llama.cpp tree of llama-cpp-python's sdist ``version``, downloaded and unpacked under ``out``."""
    tree = os.path.join(out, f"llama_cpp_python-{version}", "vendor", "llama.cpp")
    if os.path.isdir(tree):
        return tree
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={version}", "-d", out], check=True)
    (archive,) = glob.glob(os.path.join(out, f"llama_cpp_python-{version}.tar.gz"))
    with tarfile.open(archive) as t:
        t.extractall(out, filter="data")
    return tree


def cmake_build(tree: str, build_dir: str, flags: list[str], targets: list[str]) -> dict[str, str]:
    """Configure ``tree`` into ``build_dir`` with ``flags`` and build ``targets``; their paths, by name."""
    programs = {t: os.path.join(build_dir, "bin", f"lib{t}.so" if t == "llama" else t) for t in targets}
    if all(os.path.exists(p) for p in programs.values()):
        return programs
    subprocess.run(["cmake", "-S", tree, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", *flags], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", build_dir, "--target", *targets, f"-j{os.cpu_count() or 1}"], check=True,
                   stdout=subprocess.DEVNULL)
    return programs


def host_flags(isa: str | None = None) -> list[str]:
    """The peer's CMake flags for this CPU (``tmac.apps.bench.peer_cmake_args``: what ``pip install '.[peer]'``
    is told), or for the extensions of tmac's ISA ``isa`` alone (``avx2``: llama.cpp as an AVX2-only CPU runs it,
    beside ``TMAC_ISA=avx2``), and a static build so that the programs run from anywhere."""
    from tmac.apps.bench import peer_cmake_args
    from tmac.base.cpu import cpu_features, machine_arch
    from tmac.kernels import isa_by_name

    features = cpu_features() if isa is None else isa_by_name(isa).features
    if not features <= cpu_features():
        raise SystemExit(f"this CPU lacks {', '.join(sorted(features - cpu_features()))} of ISA {isa}")
    # OpenMP as the pip-built peer has it
    return [*peer_cmake_args(features, machine_arch() == "x86_64").split(), "-DGGML_OPENMP=ON",
            "-DBUILD_SHARED_LIBS=OFF"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--version", default=DEFAULT_VERSION, help="llama-cpp-python's sdist (default: the peer's)")
    p.add_argument("--out", default=os.path.join(os.path.expanduser("~"), ".cache", "tmac-bench", "llama-host"))
    p.add_argument("--isa", help="build for the extensions of this tmac ISA only (tmac info names them), e.g. avx2")
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ensure_tools({"cmake": "cmake", "c++": "g++"})
    flags = host_flags(args.isa)
    # one build folder per flag set: a CPU with other extensions gets its own programs
    key = hashlib.sha256(" ".join(flags).encode()).hexdigest()[:12]
    tree = source(args.version, args.out)
    programs = [t for t in args.targets if t != "libllama"]
    if programs:
        for name, path in cmake_build(tree, os.path.join(args.out, f"build-{key}"), flags, programs).items():
            print(f"{name}={path}")
    if "libllama" in args.targets:
        shared = [f for f in flags if not f.startswith("-DBUILD_SHARED_LIBS")] + ["-DBUILD_SHARED_LIBS=ON"]
        built = cmake_build(tree, os.path.join(args.out, f"shared-{key}"), shared, ["llama"])["llama"]
        print(f"libllama={os.path.dirname(built)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
