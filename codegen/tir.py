"""What every generated function shares: TVM's IR builder around one no-alias TIR function, and arguments declared
unaligned (a torch view or numpy slice may start anywhere; an aligned declaration would fault on it)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def prim_func(name: str):
    """Build the TIR function ``name`` in the block; ``.get()`` of the yielded builder returns it afterwards."""
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name(name)
            T.func_attr({"tir.noalias": True})
            yield ib


def arg(name: str, shape, dtype: str = "float32"):
    """The next argument of the function being built: a buffer of ``shape`` and ``dtype``, any alignment."""
    from tvm.script.ir_builder import tirx as T

    return T.match_buffer(T.arg(name, T.handle()), shape, dtype, align=1)


def prefetch(buffer, index, level: int = 1) -> None:
    """Emit a read prefetch of ``buffer[index]`` into L1 (x86 ``prefetcht0``, arm64 ``prfm pldl1keep``) or, at
    ``level`` 2, into L2 (``prefetcht1``, ``prfm pldl2keep``): a hint that never faults, so an index past the buffer's
    end (the end of a stream read ahead) is harmless."""
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    # llvm.prefetch(address, rw = 0: read, locality: 3 keeps it in every level, 2 from L2 on; cache type = 1: data)
    T.evaluate(tirx.call_llvm_intrin("void", "llvm.prefetch.p0", tirx.address_of(buffer[index]),
                                     *(tirx.IntImm("int32", a) for a in (0, 4 - level, 1))))


def chunk_row(mb, blk, r, r0, rc):
    """K chunks (tmac.execution.packing): chunk c of W, S and Z holds every block's rows (steps, weight or super
    groups) of its activations, so row r of block blk in a chunk of rows [r0, r0 + rc) is flat row mb·r0 + blk·rc +
    (r − r0), where mb blocks make the weight."""
    return mb * r0 + blk * rc + (r - r0)
