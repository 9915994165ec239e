"""Collects every benchmark's median and prints ratio tables at the end (ratios within one run only)."""

import pytest

import tmac  # before torch, so that torch's OpenMP workers wait passively instead of spinning on the kernels' cores
import torch
from tmac.bench import BUSY_LIMIT, cpu_busy_fraction

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
    if not RESULTS:
        return
    tr = terminalreporter
    groups = sorted({k[:3] for k in RESULTS}, key=str)
    for regime, threads, shape in groups:
        base = RESULTS.get((regime, threads, shape, "torch fp32"))
        int4 = RESULTS.get((regime, threads, shape, "torch int4wo"))
        what = shape if isinstance(shape, str) else f"GEMV {shape[0]}x{shape[1]}"
        tr.write_line(f"\n{regime}, {threads} thread(s), {what}:")
        tr.write_line(f"  {'candidate':<16}{'ms':>9}{'vs fp32':>10}{'vs int4wo':>11}{'GB/s':>8}")
        for (r, t, s, cand), sec in sorted(RESULTS.items(), key=lambda kv: kv[1]):
            if (r, t, s) != (regime, threads, shape):
                continue
            gbs = BYTES.get((s, cand))
            tr.write_line(f"  {cand:<16}{sec * 1e3:>9.3f}{(base / sec if base else float('nan')):>9.2f}x"
                          f"{(int4 / sec if int4 else float('nan')):>10.2f}x"
                          f"{(gbs / sec / 1e9 if gbs else float('nan')):>8.1f}")


BYTES: dict[tuple, int] = {}  # (shape, candidate) → weight bytes streamed per call
