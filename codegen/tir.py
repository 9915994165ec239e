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
