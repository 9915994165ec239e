"""The README's tables of formats, ISAs and model families, made from the format table, the ISA descriptions and
the architecture records.

``python -m tmac.apps.doc_tables README.md`` rewrites the tables between their markers; a test checks the README
holds what this module makes, so the manual cannot drift from the code.
"""

from __future__ import annotations

import sys

from tmac.base.formats import BITS, FORMATS, GROUP_SIZES, PER_ROW, PER_TENSOR


def formats_table() -> str:
    rows = ["| format | weight bits | group | scale, zero | from |", "|---|---|---|---|---|"]
    grids: dict[tuple, list] = {}  # the grid i-quants, a row for those alike: (bits, group, params) → formats
    for f in FORMATS.values():
        group = f"{f.group_size}" + (f" in {f.super_group}" if f.super_group else "")
        params = f.scale_dtype + (f", {f.zero_dtype}" if f.has_zeros else "")
        bits = "ternary" if f.ternary else f"{f.bits}, {len(f.codebook)} levels" if f.codebook else f.bits
        if f.codebook and f.gguf and f.gguf.type_size * 8 < f.bits * f.gguf.block_size:
            grids.setdefault((bits, group, params), []).append(f)
            continue
        source = f"GGUF {f.gguf.type_name}, exactly" if f.gguf else "BitNet b1.58 checkpoints, exactly"
        rows.append(f"| `{f.name}` | {bits} | {group} | {params} | {source} |")
    for (bits, group, params), fs in grids.items():  # (held as 4-bit codes, above their files' bits a weight)
        files = ", ".join(f.gguf.type_name for f in fs)
        rows.append(f"| {', '.join(f'`{f.name}`' for f in fs)} | {bits} | {group} | {params} | GGUF {files}, "
                    f"exactly |")
    rows.append(f"| `w<bits>g<group>` | {', '.join(map(str, BITS))}, ternary | {', '.join(map(str, GROUP_SIZES))}, "
                f"{PER_ROW}, {PER_TENSOR} | float16 or float32, zeros optional | `quantize_weight`, `bits=` "
                f"(requantizing) |")
    return "\n".join(rows)


def isas_table() -> str:
    from tmac.kernels import ISAS

    rows = ["| ISA (`tmac info`) | arch | needs | lookups |", "|---|---|---|---|"]
    for isa in ISAS.values():
        needs = ", ".join(sorted(isa.features)) or "—"
        rows.append(f"| `{isa.name}` | {isa.arch} | {needs} | {isa.description} |")
    return "\n".join(rows)


def families_table() -> str:
    from tmac.models.family.arch import model_table

    return model_table()


def sampling_table() -> str:
    """The sampling options as ``SamplingParams`` writes them: flag, Python and API name, default, what it does."""
    from tmac.models.run.sampling import OPTIONS, _bounds

    rows = ["| `tmac run` flag | Python, API | default | does |", "|---|---|---|---|"]
    for name, f in OPTIONS.items():
        meta = f.metadata
        flag = f"`--{name.replace('_', '-')}`" + "".join(f", `{x}`" for x in meta["flags"] if not x.startswith("--"))
        names = ", ".join(f"`{n}`" for n in (name, *meta["aliases"]))
        bounds = f"; {_bounds(meta)}" if meta["low"] is not None and meta["kind"] in ("int", "float") else ""
        rows.append(f"| {flag if meta['cli'] else '—'} | {names} | {meta['shown']} | {meta['help']}{bounds} |")
    return "\n".join(rows)


TABLES = {"formats": formats_table, "isas": isas_table, "families": families_table, "sampling": sampling_table}


def render(text: str) -> str:
    """``text`` with every generated table brought up to date (what lies between its markers replaced)."""
    for name, make in TABLES.items():
        start = f"<!-- table: {name} -->\n"
        at = text.find(start)
        if at < 0:
            continue
        end = text.index("<!-- /table -->", at + len(start))
        text = text[:at + len(start)] + make() + "\n" + text[end:]
    return text


if __name__ == "__main__":
    path = sys.argv[1]
    with open(path) as f:
        old = f.read()
    new = render(old)
    if new != old:
        with open(path, "w") as f:
            f.write(new)
    print(f"{path}: {'updated' if new != old else 'up to date'}")
