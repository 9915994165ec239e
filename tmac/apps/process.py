"""Settings of a whole process, applied only by what owns it — the command line, the server and its replicas, the
benchmarks — never by library code: ``import tmac``, ``load_model`` and a ``Session`` leave the environment, torch's
thread count and torch itself as they found them (a user's own torch code in the same process is not ours to
change). docs/decisions.md, "torch runs on one thread", says why each setting pays."""

from __future__ import annotations

import contextlib
import os
import sys

# the environment variables this process chose for itself (a child that should run with the user's own settings,
# the benchmark's llama.cpp peer, gets them removed: ``user_environment``)
CHOSEN: dict[str, str] = {}


def prefer_passive_openmp() -> None:
    """torch's OpenMP workers sleep when idle instead of spinning, where the user set nothing: spinning workers take
    the cores the kernels' own pool needs. Chosen before torch loads its OpenMP runtime, or not at all."""
    if "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = CHOSEN["OMP_WAIT_POLICY"] = "PASSIVE"


def user_environment() -> dict[str, str]:
    """This process's environment without what it chose for itself."""
    return {k: v for k, v in os.environ.items() if CHOSEN.get(k) != v}


def own_torch_threads(model, otherwise: int | None = None) -> None:
    """torch on one thread for a model with LUT layers: the torch ops between its kernel calls are small, and a
    multi-threaded one leaves workers on the cores the kernels' pool needs; a float model (or none) gets
    ``otherwise`` threads where given, else keeps torch's."""
    import torch

    from tmac.nn.linear import Linear

    if model is not None and any(isinstance(m, Linear) for m in model.modules()):
        torch.set_num_threads(1)
    elif otherwise is not None:
        torch.set_num_threads(otherwise)


def freeze_imports() -> None:
    """What the command's imports made (torch's half a million objects, which live as long as the process) moved
    out of the garbage collector's reach, and collection turned back on: the command line's entry point holds it
    off until here (``tmac.apps.console``), since each full collection during the imports and a model's load walks
    them all and frees next to nothing (their garbage: ~7000 small objects, kept). Once per process; harmless
    where collection was never off."""
    import gc

    gc.freeze()
    gc.enable()


def freeze_what_loading_made() -> None:
    """The objects alive after a load (torch's, the model's, the server's modules) moved out of the garbage
    collector's reach: they live as long as the process, and walking them again costs each full collection while
    it generates and about a second at exit (a server asked to stop would take that long to go)."""
    import gc

    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def torch_single_threaded():
    """torch on one thread inside the block (a benchmark's timed region), its own count restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
