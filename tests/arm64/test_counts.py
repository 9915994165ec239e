"""The instruction-counting qemu plugin that bench/arm64_counts.py uses (bench/arm64/count_insns.c) counts a known
aarch64 loop exactly: N iterations of a 4-instruction body between a 2-instruction entry and a 4-instruction exit."""

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.join(os.path.dirname(__file__), "..", "..")
LOOP = """
    .text
    .global _start
_start:
    mov x0, #{n}
    bl counted_loop
    mov x8, #93
    mov x0, #0
    svc #0
counted_loop:
1:  add x1, x1, #1
    eor x2, x2, x1
    subs x0, x0, #1
    b.ne 1b
    ret
"""


def _compiler(target: str | None) -> list[str]:
    """A C compiler for the host (``target`` None) or for aarch64 Linux: the system's, else zig's (the ziglang
    wheel tmac's kernels link with)."""
    if target is None and shutil.which("cc"):
        return ["cc"]
    if target is not None and shutil.which("aarch64-linux-gnu-gcc"):
        return ["aarch64-linux-gnu-gcc"]
    return [sys.executable, "-m", "ziglang", "cc", *(["-target", target] if target else [])]


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    so = str(tmp_path_factory.mktemp("plugin") / "count_insns.so")
    subprocess.run([*_compiler(None), "-shared", "-fPIC", "-O2", "-fvisibility=hidden", "-o", so,
                    os.path.join(REPO, "bench", "arm64", "count_insns.c")], check=True)
    return so


@pytest.mark.parametrize("n", [1, 1000, 65535])
def test_the_plugin_counts_a_known_loop_exactly(plugin, tmp_path, n):
    source, program, counts = tmp_path / "loop.S", tmp_path / "loop", tmp_path / "counts.txt"
    source.write_text(LOOP.format(n=n))
    subprocess.run([*_compiler("aarch64-linux-musl"), "-nostdlib", "-static", "-o", str(program), str(source)],
                   check=True)
    r = subprocess.run([shutil.which("qemu-aarch64") or "qemu-aarch64", "-cpu", "cortex-a76", "-plugin",
                        f"{plugin},out={counts}", str(program)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    blocks = [tuple(int(x, 16) if i == 0 else int(x) for i, x in enumerate(line.split()))
              for line in counts.read_text().splitlines()]
    assert sum(insns * runs for _, insns, runs in blocks) == 2 + 4 * n + 4
    loop = [(insns, runs) for _, insns, runs in blocks if insns == 4]
    assert loop == [(4, n)], blocks  # the body: one block, run once an iteration
