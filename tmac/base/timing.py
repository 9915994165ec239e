"""Timing a call warm (in cache) and cold (its weights streaming from DRAM), and the read probe a weight stream is
measured against. Speeds are compared as ratios of candidates timed interleaved in one run: a shared host's slower
stretches then hit every candidate alike."""

from __future__ import annotations

import statistics
import time

COLD_BYTES = 1 << 30  # weight copies cycled for cold timing (256 MiB ran a 4096x11008 W4 GEMV 1.7x faster: cached)
BUSY_LIMIT = 0.25  # share of all CPUs busy before a multi-thread run above which its numbers would be noise


def cpu_busy_fraction(seconds: float = 0.5) -> float:
    """Share of all CPUs busy during ``seconds`` (from /proc/stat; 0.0 where that does not exist)."""
    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]
    try:
        t0, i0 = snap()
        time.sleep(seconds)
        t1, i1 = snap()
    except OSError:
        return 0.0
    return 1 - (i1 - i0) / max(t1 - t0, 1)


def median_seconds(fn, min_seconds: float = 0.3, min_runs: int = 5) -> float:
    """Median wall time of ``fn()`` after one warm-up call, over at least ``min_runs`` calls and ``min_seconds``."""
    return warm_medians([fn], min_seconds, min_runs)[0]


def warm_medians(fns, min_seconds: float = 0.3, min_runs: int = 5) -> list[float]:
    """Median wall time of each of ``fns``, called in turns (one call of each per pass, after a warm-up pass), so a
    slower stretch of a shared host hits them alike: over at least ``min_runs`` passes and ``min_seconds`` each."""
    for fn in fns:
        fn()
    times, start = [[] for _ in fns], time.perf_counter()
    while len(times[0]) < min_runs or time.perf_counter() - start < min_seconds * len(fns):
        for fn, t in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def cold_medians(candidates, min_seconds: float = 0.3, each_pass=None) -> list[float]:
    """Median seconds of a cold call of each candidate ``(make, call, nbytes)``, all timed together: ``make(n)``
    returns ``n`` copies of its weights (``COLD_BYTES`` for all candidates together) and ``call(copy)`` runs on one.
    A pass calls every candidate's first copy, then every candidate's second …, so each call streams its weights
    from DRAM and a slower stretch of the shared host hits every candidate alike; ``each_pass()`` runs before
    each pass. The first pass warms up."""
    per = max(2, COLD_BYTES // sum(nbytes for _, _, nbytes in candidates))
    copies = [make(per) for make, _, _ in candidates]
    times = [[] for _ in candidates]
    start, passes = time.perf_counter(), 0
    while passes < 3 or time.perf_counter() - start < min_seconds * len(candidates):
        if each_pass:
            each_pass()
        for i in range(per):
            for (_, call, _), c, t in zip(candidates, copies, times):
                t0 = time.perf_counter()
                call(c[i])
                t.append(time.perf_counter() - t0)
        passes += 1
    return [statistics.median(t[per:]) for t in times]


def cold_medians_beside_probe(candidates) -> tuple[list[float], float]:
    """``cold_medians`` with the 1 GiB read probe (``read_probe``) timed before each pass: the candidates' medians,
    and the probe's seconds from the same passes (a share of it does not drift with the shared host)."""
    probe, passes = read_probe(), []
    medians = cold_medians(candidates, each_pass=lambda: passes.append(read_seconds(probe)))
    return medians, statistics.median(passes[1:])


def read_probe():
    """``COLD_BYTES`` of float32 in huge pages, as a loaded model's weights: its ``sum()`` is the read probe, the
    bandwidth a decode step's weight stream is measured against."""
    import torch

    from tmac.base.memory import huge_page_full

    return huge_page_full((COLD_BYTES // 4,), 1.0, torch.float32)


def read_seconds(probe) -> float:
    """Seconds of one read of the probe (``read_probe``): ``COLD_BYTES`` streamed from DRAM."""
    t0 = time.perf_counter()
    probe.sum()
    return time.perf_counter() - t0


def process_seconds() -> float:
    """Seconds since this process started (Linux: its start time in /proc against the system's uptime, so the
    interpreter's own start and every import count; elsewhere since this module was imported)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        import os

        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()
