"""Hashes of the assembly every default kernel spec compiles to, for checking that a refactoring leaves the generated
code byte-identical.

Every format of the format table at a few K, and the decode glue of a Llama and a BitNet model, on every ISA
(x86-64 and arm64 alike: TVM cross-compiles to assembly without running it), with the default tiling (no
``tuning.json``: the cache directory is a fresh temporary one).

Run: ``python bench/asm_hashes.py -o before.json``, change the code, then
``python bench/asm_hashes.py --compare before.json`` (exit status 1 when any hash differs).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from multiprocessing import Pool

K_VALUES = (576, 1536, 4096)
GLUE_DIMS = dict(dim=576, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536)  # SmolLM2-135M's


def jobs() -> list[tuple]:
    from tmac.base.formats import FORMATS
    from tmac.kernels import ISAS

    out = []
    for isa in ISAS:
        ks = K_VALUES[:1] if isa.startswith("generic") else K_VALUES  # (generic kernels compile 10x slower)
        out += [("lut", isa, fmt, k) for fmt in FORMATS for k in ks]
        out += [("glue", isa, variant, 0) for variant in ("llama", "bitnet", "llama-q4-table")]
    return out


def spec_of(kind: str, isa_name: str, what: str, k: int):
    from tmac.base.formats import FORMATS
    from tmac.base.glue import GlueSpec
    from tmac.kernels import ISAS
    from tmac.quant.choose import spec_for_format

    isa = ISAS[isa_name]
    if kind == "lut":
        return spec_for_format(FORMATS[what], k, isa)
    bitnet = what == "bitnet"
    embed = dict(embed_bits=4, embed_groups=GLUE_DIMS["dim"] // 32, embed_scale="float16",
                 embed_zero="float16") if what.endswith("table") else {}
    d = GLUE_DIMS
    return GlueSpec(isa.name, d["dim"], d["n_heads"], d["n_kv_heads"], d["head_dim"], d["ffn_dim"],
                    "relu2" if bitnet else "silu", bitnet, bitnet, "float16", **embed)


def asm_hash(job: tuple) -> tuple[str, str]:
    from tmac.codegen.build import compile_kernel
    from tmac.kernels import ISAS

    kind, isa_name, what, k = job
    name = f"{kind}:{isa_name}:{what}" + (f":K{k}" if k else "")
    try:
        spec = spec_of(*job)
        asm = compile_kernel(spec, ISAS[isa_name]).mod.inspect_source("asm")
    except Exception as e:  # (a spec an ISA cannot take is part of the record too)
        return name, f"error: {type(e).__name__}: {e}"
    return name, hashlib.sha256(asm.encode()).hexdigest()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--output", help="write the hashes to this JSON file")
    p.add_argument("--compare", help="compare with hashes written before")
    p.add_argument("-j", "--jobs", type=int, default=os.cpu_count())
    args = p.parse_args()
    os.environ["TMAC_CACHE_DIR"] = tempfile.mkdtemp(prefix="tmac-asm-")  # no tuning.json: default tilings
    todo = jobs()
    hashes = {}
    with Pool(args.jobs) as pool:
        for i, (name, digest) in enumerate(pool.imap_unordered(asm_hash, todo), 1):
            hashes[name] = digest
            if sys.stderr.isatty():
                print(f"\r{i}/{len(todo)} specs compiled", end="", file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    hashes = dict(sorted(hashes.items()))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(hashes, f, indent=1)
    if not args.compare:
        print(f"{len(hashes)} specs, {sum(v.startswith('error') for v in hashes.values())} not compilable")
        return 0
    with open(args.compare) as f:
        before = json.load(f)
    changed = sorted(n for n in before.keys() | hashes.keys() if before.get(n) != hashes.get(n))
    for n in changed:
        print(f"differs: {n}: {before.get(n, '(absent)')[:24]} -> {hashes.get(n, '(absent)')[:24]}")
    print(f"{len(hashes)} specs: {len(hashes) - len(changed)} identical, {len(changed)} differ")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
