"""``tmac convert``'s work as a library call: a model from any source written as a pre-packed ``.tmac`` file."""

from __future__ import annotations

import os
import time

import torch

from tmac.quant.embedding import Embedding
from tmac.base.files import check_output
from tmac.nn.linear import Linear

from tmac.models.files.load import load_model
from tmac.models.files.tmac_file import save_model


def convert(source: str, output: str, *, bits: int | None = None, group_size: int | None = None,
            head_bits: int | str | None = None, shared_table: bool = False, isa: str | None = None,
            progress: bool | None = True) -> dict:
    """Load ``source`` (as ``load_model`` takes it) and write it pre-packed to ``output``, a ``.tmac`` file; the
    output is checked first (never the input, a special file or a missing directory). Returns what was written:
    its layers, formats, bytes by part (projections, head, token table, other), file and source sizes, whether the
    token table is the head's (``shared_table``: ``save_model``), the ISA packed for, whether its kernels were
    compiled into this machine's cache, and the seconds taken.

    ``isa`` packs for another CPU (``tmac.kernels.ISAS``' names: e.g. ``neon_dotprod`` for a Raspberry Pi 5,
    ``neon`` for a Pi 4): packing is seconds here and minutes on a small board. A file packed for one ISA runs
    anywhere, but another CPU repacks it at every load. Its kernels compile here only where this CPU can run them
    (else on the target at its first run, or here with ``tmac compile --isa ISA --model OUT.tmac``)."""
    from tmac.kernels import best_isa, isa_by_name, lacking

    from tmac.models.files.hub import resolve
    from tmac.models.files.load import default_model_path

    source = default_model_path() if source is None else resolve(os.fspath(source))  # (a repo id: its file)
    check_output(output, [source])  # before the conversion, not after it
    t0 = time.perf_counter()
    target = isa_by_name(isa) if isa else best_isa()
    model = load_model(source, bits=bits, group_size=group_size, head_bits=head_bits, context=1,
                       isa=target.name if isa else None, progress=progress)
    shared = save_model(model, output, shared_table)
    compiled = not lacking(target)
    if compiled:
        _compile_for(output, target)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    parts = {"projections": 0, "head": 0, "token table": 0, "other": 0}
    for name, t in model.state_dict().items():
        if isinstance(t, torch.Tensor):
            part = "head" if name.startswith("output.") else "token table" if name.startswith("tok_embeddings.") \
                else "projections" if name.startswith("layers.") and t.dim() > 1 else "other"
            parts[part] += t.numel() * t.element_size()
    if shared:
        parts["token table"] = 0
    return {"source": source, "output": output, "quantized_layers": len(linears),
            "formats": sorted({m.format.name for m in linears}), "bytes": parts,
            "file_bytes": os.path.getsize(output), "source_bytes": _size_of(source),
            "table_from_head": bool(shared) and isinstance(model.tok_embeddings, Embedding),
            "isa": target.name, "kernels_compiled": compiled, "seconds": time.perf_counter() - t0}


def _compile_for(path: str, isa) -> None:
    """Every kernel a run of the converted file takes on this CPU into the kernel cache (compiled where missing):
    its first run then compiles nothing."""
    from tmac.execution.runtime import load_kernels

    from tmac.models.run.kernel_specs import model_kernel_specs

    for spec in model_kernel_specs(path, isa):
        load_kernels(spec, isa)


def _size_of(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    return os.path.getsize(path)
