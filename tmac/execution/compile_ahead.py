"""The child process of ``tmac.execution.prefetch``: compiles each kernel spec it reads (JSON, a line each, from standard
input) into the kernel cache unless it is there, and says so in a whole line on standard error."""

from __future__ import annotations

import json
import sys
import time

from tmac.base.glue import GlueSpec
from tmac.quant.spec import KernelSpec


def main() -> int:
    for line in sys.stdin:
        try:
            item = json.loads(line)
            spec = GlueSpec(**item["spec"]) if item["kind"] == "glue" else KernelSpec.from_dict(item["spec"])
            started = time.perf_counter()
            if _compile(spec):
                print(f"tmac: compiled kernel {spec.name} ahead, while loading ... {time.perf_counter() - started:.1f}s",
                      file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001  (the run compiles it on first use, and says why it cannot)
            print(f"tmac: compiling a kernel ahead failed ({type(e).__name__}: {e}); it compiles on first use",
                  file=sys.stderr, flush=True)
    return 0


def _compile(spec) -> bool:
    """Compile ``spec`` into the cache unless it is there (or another process compiled it meanwhile); whether it
    was compiled here."""
    from tmac.quant.cache import cache_dir, cached_library
    from tmac.kernels import isa_by_name
    from tmac.execution.runtime import _from_cache

    isa = isa_by_name(spec.isa)
    if cached_library(cache_dir(), spec, isa):
        return False
    _from_cache(spec, isa, progress=False)
    return True


if __name__ == "__main__":
    sys.exit(main())
