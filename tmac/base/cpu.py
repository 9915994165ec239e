"""What CPU this is: architecture, the SIMD features that matter for the LUT kernels, physical cores."""

from __future__ import annotations

import functools
import os
import platform
import re

FEATURES = ("avx2", "avx512bw", "avx512vnni", "avx512vbmi", "avx512bf16", "avxvnni", "neon", "dotprod")

# /proc/cpuinfo flag names → our feature names
_X86_FLAGS = {"avx2": "avx2", "avx512bw": "avx512bw", "avx512_vnni": "avx512vnni", "avx512vbmi": "avx512vbmi",
              "avx512_bf16": "avx512bf16", "avx_vnni": "avxvnni"}
_ARM_FLAGS = {"asimd": "neon", "asimddp": "dotprod"}
# arm64 Linux: the kernel's hardware capability bits (asm/hwcap.h) — what /proc/cpuinfo prints, but also right
# under qemu-user, whose /proc/cpuinfo is the host's
_AT_HWCAP = 16
_ARM_HWCAPS = {"neon": 1 << 1, "dotprod": 1 << 20}


ARCHES = ("x86_64", "arm64")  # the names tmac uses; other spellings are aliases
ARCH_ALIASES = {"x86-64": "x86_64", "amd64": "x86_64", "aarch64": "arm64"}


def normalize_arch(name: str) -> str:
    """tmac's name of an architecture given by any usual spelling (``aarch64`` → ``arm64``)."""
    arch = ARCH_ALIASES.get(name.lower(), name.lower())
    if arch not in ARCHES:
        raise ValueError(f"unknown architecture {name!r}; known: {', '.join(ARCHES)} (or {', '.join(ARCH_ALIASES)})")
    return arch


def machine_arch() -> str:
    m = platform.machine().lower()
    return ARCH_ALIASES.get(m, m)


@functools.lru_cache(maxsize=1)
def cpu_features() -> frozenset[str]:
    arch = machine_arch()
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        m = re.search(r"^(flags|Features)\s*:(.*)$", text, re.M)
        flags = set(m.group(2).split()) if m else set()
    except OSError:
        pass
    table = _X86_FLAGS if arch == "x86_64" else _ARM_FLAGS
    found = {ours for theirs, ours in table.items() if theirs in flags}
    if arch == "arm64" and platform.system() == "Linux":
        found = _arm_hwcaps()
    if arch == "arm64" and platform.system() == "Darwin":  # Apple silicon: NEON and dotprod always
        found |= {"neon", "dotprod"}
    return frozenset(found)


def _arm_hwcaps() -> set[str]:
    import ctypes

    try:
        getauxval = ctypes.CDLL(None).getauxval
    except (OSError, AttributeError):
        return set()
    getauxval.restype, getauxval.argtypes = ctypes.c_ulong, [ctypes.c_ulong]
    hwcap = getauxval(_AT_HWCAP)
    return {name for name, bit in _ARM_HWCAPS.items() if hwcap & bit}


@functools.lru_cache(maxsize=1)
def physical_cores() -> int:
    """Physical cores (not SMT siblings) this process may run on."""
    try:
        allowed = os.sched_getaffinity(0)
    except AttributeError:
        allowed = set(range(os.cpu_count() or 1))
    cores = set()
    for cpu in allowed:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/core_id") as f:
                core = f.read().strip()
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id") as f:
                pkg = f.read().strip()
            cores.add((pkg, core))
        except OSError:
            cores.add(("?", cpu))
    return max(1, len(cores))


@functools.lru_cache(maxsize=1)
def usable_cpus() -> int:
    """CPUs this process may run on at once: its affinity mask, capped by a cgroup CPU quota (a container's
    ``--cpus``), rounded up."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(n, quota) if quota else n)


def _cgroup_cpu_quota() -> int | None:
    import math

    try:  # cgroup v2: "max 100000" or "200000 100000"
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError, ZeroDivisionError):
        pass
    try:  # cgroup v1
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period = int(f.read())
        return None if quota <= 0 else max(1, math.ceil(quota / period))
    except (OSError, ValueError, ZeroDivisionError):
        return None
