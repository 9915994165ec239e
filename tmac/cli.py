"""The ``tmac`` command line. Errors print one line and exit non-zero; ``--debug`` shows the traceback."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import time

from . import cli_generate
from .formats import GROUP_SIZES, PER_ROW, PER_TENSOR, WeightFormat


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one clear line for a person; the traceback only on request
        if args.debug:
            raise
        print(f"tmac {args.command}: error: {e}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tmac", description="Low-bit LLM inference on CPUs with table lookups.")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="CPU features, kernel ISA, threads, versions, kernel cache")
    info.set_defaults(func=cmd_info)

    c = sub.add_parser("compile", help="compile LUT kernels into a directory (cross-compiles for arm64)")
    c.add_argument("--arch", choices=["x86_64", "arm64"], default=None, help="target architecture (default: this)")
    c.add_argument("--isa", choices=["avx512", "avx2", "avx2-vnni", "neon", "neon-dotprod", "generic"],
                   help="instruction set (default: this CPU's best, or the common one of --arch)")
    c.add_argument("--bits", type=int, required=True, choices=[1, 2, 3, 4])
    c.add_argument("--group-size", default="128", help=f"one of {GROUP_SIZES}, '{PER_ROW}' or '{PER_TENSOR}'")
    c.add_argument("--symmetric", action="store_true", help="weights without zeros")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--shape", nargs="+", action="extend", metavar="MxK", help="weight shapes (out x in features)")
    src.add_argument("--model", metavar="PATH", help="a GGUF model: compile for every linear layer's K")
    c.add_argument("-o", "--output", required=True, metavar="DIR")
    c.set_defaults(func=cmd_compile)
    cli_generate.add_parsers(sub, common)
    return p


# ---- info -------------------------------------------------------------------------------------------------------

def cmd_info(args) -> int:
    from . import runtime
    from .cpu import FEATURES, cpu_features, machine_arch, physical_cores
    from .kernels import best_isa

    arch, feats = machine_arch(), cpu_features()
    try:
        isa = best_isa()
        isa_line = f"{isa.name} — {isa.description}"
        if isa.name.startswith("generic"):
            isa_line += "  [FALLBACK: no table-lookup instructions found; kernels will be slow]"
    except ValueError as e:
        isa_line = f"none ({e})"
    rows = [
        ("tmac", _version("tmac")),
        ("architecture", arch),
        ("SIMD features", "  ".join(f"{f} {'yes' if f in feats else 'no'}" for f in FEATURES)),
        ("kernel ISA", isa_line),
        ("threads", f"{runtime.get_num_threads()} (physical cores {physical_cores()}; TMAC_NUM_THREADS overrides)"),
        ("torch", _version("torch")),
        ("apache-tvm", _version("apache-tvm")),
        ("apache-tvm-ffi", _version("apache-tvm-ffi")),
        ("kernel cache", runtime.cache_dir()),
        ("kernel dir", os.environ.get("TMAC_KERNEL_DIR") or "(none; set TMAC_KERNEL_DIR)"),
    ]
    _print_table(rows)
    return 0


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _print_table(rows, header=None) -> None:
    rows = [tuple(str(c) for c in r) for r in rows]
    if header:
        rows = [tuple(header)] + rows
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for n, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if header and n == 0:
            print("  ".join("-" * w for w in widths))


# ---- compile ------------------------------------------------------------------------------------------------------

def parse_group_size(text: str) -> int | str:
    if text in (PER_ROW, PER_TENSOR):
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--group-size must be one of {GROUP_SIZES}, '{PER_ROW}' or '{PER_TENSOR}', got {text!r}") from None


def parse_shape(text: str) -> tuple[int, int]:
    try:
        m, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--shape takes MxK (e.g. 4096x4096), got {text!r}") from None
    if m <= 0 or k <= 0:
        raise ValueError(f"--shape dimensions must be positive, got {text!r}")
    return m, k


def resolve_isa(arch: str | None, isa_choice: str | None):
    from .cpu import machine_arch
    from .kernels import ISA_CHOICES, best_isa, isa_by_name

    arch = arch or machine_arch()
    if isa_choice is None:
        if arch == machine_arch():
            return best_isa()
        return isa_by_name({"arm64": "neon_dotprod", "x86_64": "avx2"}[arch])
    name = ISA_CHOICES[isa_choice] or f"generic_{arch}"
    isa = isa_by_name(name)
    if isa.arch != arch:
        raise ValueError(f"--isa {isa_choice} is for {isa.arch}, not --arch {arch}")
    return isa


def model_in_features(path: str) -> list[int]:
    """Distinct K of the 2-D weight tensors of a GGUF model (the inputs of its linear layers)."""
    from .models.gguf_file import GGUFFile

    if not os.path.isfile(path):
        raise FileNotFoundError(f"model file not found: {path}")
    ks = {t.shape[1] for t in GGUFFile(path).tensors.values() if len(t.shape) == 2 and t.name.endswith(".weight")}
    if not ks:
        raise ValueError(f"{path}: no 2-D weight tensors found")
    return sorted(ks)


def cmd_compile(args) -> int:
    from . import runtime
    from .codegen.build import build_library, linker_for
    from .packing import spec_for_format

    isa = resolve_isa(args.arch, args.isa)
    linker_for(isa.arch)  # fail early, naming the Debian package, when the cross linker is missing
    group = parse_group_size(args.group_size)
    fmt = WeightFormat.rtn(args.bits, group, args.symmetric)
    ks = sorted({parse_shape(s)[1] for s in args.shape}) if args.shape else model_in_features(args.model)
    specs = [spec_for_format(fmt, k, isa) for k in ks]  # raises naming K when the group size does not divide it
    os.makedirs(args.output, exist_ok=True)
    entries, rows = [], []
    for i, spec in enumerate(specs, 1):
        print(f"[{i}/{len(specs)}] compiling K={spec.k} for {isa.name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        path = os.path.join(args.output, spec.name + ".so")
        tmp = path + ".tmp"
        build_library(spec, isa, tmp)
        os.replace(tmp, path)
        entries.append(runtime.kernel_entry(spec, isa, os.path.basename(path), runtime.sha256(path)))
        rows.append((spec.name, spec.k, spec.bits, spec.group_size, f"{time.perf_counter() - t0:.2f}",
                     os.path.getsize(path)))
    manifest = {"format": 1, "arch": isa.arch, "isa": isa.name, "tvm_version": runtime.tvm_version(),
                "kernels": entries}
    with open(os.path.join(args.output, "manifest.json.tmp"), "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(os.path.join(args.output, "manifest.json.tmp"), os.path.join(args.output, "manifest.json"))
    _print_table(rows, header=("kernel", "K", "bits", "group", "seconds", "bytes"))
    print(f"wrote {len(entries)} kernel(s) and manifest.json to {args.output} ({isa.arch}, {isa.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
