"""Collects every benchmark's median and prints ratio tables at the end (ratios within one run only)."""

import os
import sys

import pytest

# not the checkout's root on sys.path: its kernels/ would stand in for Hugging Face's (tests/conftest.py says why)
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]

import tmac  # noqa: E402 — before torch, so that torch's OpenMP workers wait passively instead of spinning on the kernels' cores
import torch  # noqa: E402
from tmac.base.timing import BUSY_LIMIT, cpu_busy_fraction  # noqa: E402

RESULTS: dict[tuple, float] = {}  # (regime, threads, shape, candidate) → median seconds


def pytest_addoption(parser):
    parser.addoption("--threads", default="1,2", help="thread counts to measure, e.g. 1 or 1,2")


def pytest_generate_tests(metafunc):
    if "threads" in metafunc.fixturenames:
        metafunc.parametrize("threads", [int(t) for t in metafunc.config.getoption("threads").split(",")])


@pytest.fixture
def set_threads(threads):
    old_t, old_k = torch.get_num_threads(), tmac.get_num_threads()
    if threads > 1:
        busy = cpu_busy_fraction()
        if busy > BUSY_LIMIT:
            pytest.skip(f"machine busy ({busy:.0%} of CPUs) before a {threads}-thread run: numbers would be noise")
    torch.set_num_threads(threads)
    tmac.set_num_threads(threads)
    yield threads
    torch.set_num_threads(old_t)
    tmac.set_num_threads(old_k)


def record(benchmark, key):
    RESULTS[key] = benchmark.stats.stats.median


def pytest_terminal_summary(terminalreporter):
    """A table per (regime, threads, shape): ms, speed-ups over torch fp32 and int4 weight-only and GB/s, and the
    share of the read probe where one was timed alongside (interleaved runs); columns without a baseline drop."""
    tr = terminalreporter
    for regime, threads, shape in sorted({k[:3] for k in RESULTS}, key=str):
        rows = sorted(((cand, sec) for (r, t, s, cand), sec in RESULTS.items()
                       if (r, t, s) == (regime, threads, shape)), key=lambda cs: cs[1])
        found = dict(rows)
        columns = [(f"vs {b.split()[-1]}", lambda cand, sec, b=b: f"{found[b] / sec:.2f}x")
                   for b in ("torch fp32", "torch int4wo") if b in found]
        columns.append(("GB/s", lambda cand, sec: f"{BYTES[(shape, cand)] / sec / 1e9:.1f}"
                        if (shape, cand) in BYTES else "—"))
        if "read 1 GiB" in found:
            probe = BYTES[(shape, "read 1 GiB")] / found["read 1 GiB"]
            columns.append(("% probe", lambda cand, sec: f"{100 * BYTES[(shape, cand)] / sec / probe:.0f} %"))
        what = shape if isinstance(shape, str) else f"GEMV {shape[0]}x{shape[1]}"
        tr.write_line(f"\n{regime}, {threads} thread(s), {what}:")
        tr.write_line(f"  {'candidate':<16}{'ms':>9}" + "".join(f"{name:>11}" for name, _ in columns))
        for cand, sec in rows:
            tr.write_line(f"  {cand:<16}{sec * 1e3:>9.3f}" + "".join(f"{fmt(cand, sec):>11}" for _, fmt in columns))


BYTES: dict[tuple, int] = {}  # (shape, candidate) → weight bytes streamed per call
