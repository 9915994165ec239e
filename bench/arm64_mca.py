"""Cycles per inner-loop iteration of arm64 kernels, by llvm-mca's model of a Cortex-A76 and a Cortex-A72: tmac's
generated NEON kernels (cross-compiled here for ``neon_dotprod`` and ``neon``) and llama.cpp's dot-product kernels
for the same types (from an aarch64 llama-bench built with symbols), with the stack loads and stores in each loop
(register spills) counted.

    python bench/arm64_mca.py KERNEL.so... [--llama-bench PATH] [--json]
    python bench/arm64_mca.py --compile [--bits 1 2 3 4] [--model FILE ...] [--types Q4_K TQ2_0 ...] [--llama-bench PATH]

A loop is a backward branch inside one function; those that do the arithmetic (SIMD table lookups, dot products,
multiply-adds; no call or return inside) and hold no smaller such loop are measured: their body, the branch back to
its start included, as a block llvm-mca repeats 100 times.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

MCPUS = ("cortex-a76", "cortex-a72")
MATTR = {"cortex-a76": "+lse,+dotprod,+fullfp16,+rcpc", "cortex-a72": "+crc"}  # (what each core has: its code may use
#                                                                                them, and llvm-mca must parse it)
BRANCH = re.compile(r"^(b\.\w+|b|cbz|cbnz|tbz|tbnz)\s")
STACK = re.compile(r"^(ldr|str|ldp|stp|ldur|stur)\w*\s.*\[sp")
LLAMA_DOTS = re.compile(r"^ggml_vec_dot_(q4_0_q8_0|q4_K_q8_K|q2_K_q8_K|tq2_0_q8_K|tq1_0_q8_K|q6_K_q8_K|q3_K_q8_K|"
                        r"q4_1_q8_1)$")
WIDENING_MUL8 = re.compile(r"^(smull2?|smlal2?)\s+v\d+\.8h")  # 8 products of int8: llama.cpp's dot without sdot
ARITHMETIC = re.compile(r"^(tbl|sdot|udot|fmla|smlal|mla|smull)\s")
MIN_INSNS = 6


def objdump() -> str:
    tool = shutil.which("aarch64-linux-gnu-objdump") or shutil.which("llvm-objdump")
    if tool is None:
        raise SystemExit("aarch64-linux-gnu-objdump (binutils-aarch64-linux-gnu) or llvm-objdump is needed")
    return tool


def functions(binary: str, only=None) -> dict[str, list[tuple[int, str]]]:
    """Each function's instructions as (address, text), from the disassembly."""
    text = subprocess.run([objdump(), "-d", "--no-show-raw-insn", binary], capture_output=True, text=True,
                          check=True).stdout
    out, current = {}, None
    for line in text.splitlines():
        head = re.match(r"^([0-9a-f]+) <(.+)>:$", line)
        if head:
            name = head.group(2)
            current = out.setdefault(name, []) if only is None or only(name) else None
            continue
        m = re.match(r"^\s+([0-9a-f]+):\s+(.*)$", line)
        if m and current is not None:
            current.append((int(m.group(1), 16), m.group(2).split("//")[0].strip()))
    return out


def functions_range(binary: str, start: int, stop: int) -> list[tuple[int, str]]:
    """The instructions of ``binary`` from address ``start`` up to ``stop``."""
    text = subprocess.run([objdump(), "-d", "--no-show-raw-insn", f"--start-address={start:#x}",
                           f"--stop-address={stop:#x}", binary], capture_output=True, text=True, check=True).stdout
    return [(int(m.group(1), 16), m.group(2).split("//")[0].strip())
            for m in re.finditer(r"^\s+([0-9a-f]+):\s+(.*)$", text, re.M)]


def compute_loops(insns: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """The loops (a backward branch's target to the branch) that do the arithmetic — SIMD table lookups, dot
    products or multiply-adds, no call or return inside — and hold no smaller such loop."""
    loops = []
    for i, (addr, text) in enumerate(insns):
        target = re.search(r"\b([0-9a-f]+) <", text) if BRANCH.match(text) else None
        if not target or int(target.group(1), 16) >= addr:
            continue
        to = int(target.group(1), 16)
        start = next((j for j, (a, _) in enumerate(insns) if a == to), None)
        if start is None or i - start + 1 < MIN_INSNS:
            continue
        body = [t for _, t in insns[start:i + 1]]
        if any(t.startswith(("ret", "bl ", "blr")) for t in body) or not any(ARITHMETIC.match(t) for t in body):
            continue
        loops.append((start, i))
    inner = [(s, e) for s, e in loops if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in loops)]
    return [insns[s:e + 1] for s, e in inner]


def mca(loop: list[tuple[int, str]], mcpu: str) -> float:
    """Cycles per iteration of ``loop`` (its last instruction branches back to its first)."""
    lines = [".Ltop:"]
    for _, text in loop:
        if BRANCH.match(text):
            text = re.sub(r"\s[0-9a-f]+ <[^>]*>", " .Ltop", text)
        lines.append("    " + re.sub(r"<[^>]*>", "", text))
    with tempfile.NamedTemporaryFile("w", suffix=".s", delete=False) as f:
        f.write("\n".join(lines) + "\n")
    try:
        tool = shutil.which("llvm-mca") or shutil.which("llvm-mca-14")
        r = subprocess.run([tool, "-mtriple=aarch64", f"-mcpu={mcpu}", f"-mattr={MATTR[mcpu]}", "-iterations=100",
                            f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if r.returncode:
        raise RuntimeError(r.stderr[-500:])
    cycles = int(re.search(r"Total Cycles:\s+(\d+)", r.stdout).group(1))
    return cycles / 100


def measure(label: str, insns: list[tuple[int, str]]) -> list[dict]:
    rows = []
    for loop in compute_loops(insns):
        row = {"kernel": label, "at": hex(loop[0][0]), "insns": len(loop),
               "spills": sum(bool(STACK.match(t)) for _, t in loop),
               "dot": sum(t.startswith(("sdot", "udot")) for _, t in loop),
               "tbl": sum(t.startswith("tbl") for _, t in loop),
               "mul8": sum(bool(WIDENING_MUL8.match(t)) for _, t in loop)}
        for mcpu in MCPUS:
            row[mcpu] = mca(loop, mcpu)
        row["weights"] = loop_weights(label, row)
        rows.append(row)
    return rows


def loop_weights(label: str, row: dict) -> int | None:
    """Weights (× rows) one iteration covers: a tmac ``tbl`` is 16 rows' lookups of one bit plane for 4 activations
    (64 / bits weights; a 4-bit codebook code is its own table: 16), llama.cpp's ``sdot`` 16 weights of one row,
    and without dotprod (a Pi 4) its widening multiply of int8 halves (``smull``/``smlal``, ``2``) 8."""
    bits = re.search(r"_b(\d+)_", label)
    if row["tbl"] and bits:
        return row["tbl"] * 64 // int(bits.group(1))
    if not label.startswith("llama.cpp"):
        return None
    return row["dot"] * 16 if row["dot"] else row["mul8"] * 8 or None


def compile_kernels(bits: list[int], models: list[str], out: str) -> list[str]:
    """tmac's LUT kernels for ``bits`` (a 2048x2048 GEMV) and for each of ``models`` (the kernels its weights load
    with), cross-compiled for both NEON ISAs."""
    paths = []
    for isa in ("neon_dotprod", "neon"):
        jobs = [(f"b{b}", ["--bits", str(b), "--shape", "2048x2048"]) for b in bits] + \
            [(f"m{i}", ["--model", m]) for i, m in enumerate(models)]
        for tag, args in jobs:
            d = os.path.join(out, f"{isa}-{tag}")
            subprocess.run([sys.executable, "-m", "tmac.apps.cli", "compile", "--arch", "aarch64", "--isa", isa,
                            *args, "-o", d], check=True, capture_output=True)
            paths += [os.path.join(d, f) for f in sorted(os.listdir(d)) if f.startswith("lut_") and f not in
                      {os.path.basename(p) for p in paths}]
    return paths


def compile_types(types: list[str], out: str) -> list[str]:
    """tmac's LUT kernels for GGUF block types (``Q4_K``, ``TQ2_0`` ...) at K = 2048 with their default tiling, for
    both NEON ISAs."""
    from tmac.base.formats import FORMATS
    from tmac.codegen.build import build_library
    from tmac.kernels import isa_by_name
    from tmac.quant.choose import spec_for_format

    paths = []
    for isa_name in ("neon_dotprod", "neon"):
        isa = isa_by_name(isa_name)
        for t in types:
            spec = spec_for_format(FORMATS[t.lower()], 2048, isa)
            path = os.path.join(out, spec.name + ".so")
            if not os.path.exists(path):
                build_library(spec, isa, path)
            paths.append(path)
    return paths


# the C runtime's and the linker's own functions in a kernel library; every other function is the kernel's (TVM's
# parallel bodies have no symbol of their own: objdump lists them under the function before them)
RUNTIME = ("_init", "_fini", ".plt", "__cxa", "__gmon", "call_weak_fn", "deregister_tm_clones", "register_tm_clones",
           "__do_global_dtors_aux", "frame_dummy", "__truncsfhf2", "__extendhfsf2")


def kernel_function(name: str) -> bool:
    return not name.startswith(RUNTIME) and not name.endswith("@plt")


def label(path: str, name: str) -> str:
    return f"{os.path.basename(path)[:-3]}:{'parallel body' if name.startswith('__tvm_set_raised') else name}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kernels", nargs="*")
    p.add_argument("--compile", action="store_true", help="cross-compile tmac's kernels for a 2048x2048 GEMV first")
    p.add_argument("--bits", nargs="+", type=int, default=[1, 2, 3, 4])
    p.add_argument("--model", nargs="+", default=[], help="with --compile: also the kernels these models load with")
    p.add_argument("--types", nargs="+", default=[], help="with --compile: also these GGUF types' kernels (K = 2048)")
    p.add_argument("--llama-bench", help="an aarch64 llama-bench with symbols (its ggml_vec_dot_* are measured)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    paths = list(args.kernels)
    if args.compile:
        out = tempfile.mkdtemp(prefix="arm64-mca-")
        paths += compile_kernels(args.bits, args.model, out) + compile_types(args.types, out)
    rows = []
    for path in paths:
        for name, insns in functions(path, kernel_function).items():
            rows += measure(label(path, name), insns)
    if args.llama_bench:
        for name, insns in functions(args.llama_bench, LLAMA_DOTS.match).items():
            rows += measure(f"llama.cpp {name}", insns)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'kernel loop':<86} {'insns':>5} {'spills':>6} {'dot':>4} {'tbl':>4} {'A76 c/it':>8} {'A72 c/it':>8} "
          f"{'c/tbl':>5} {'A76 c/kw':>8} {'A72 c/kw':>8}")
    for r in rows:
        per = f"{r['cortex-a76'] / r['tbl']:>5.2f}" if r["tbl"] else f"{'-':>5}"
        kw = " ".join(f"{1000 * r[cpu] / r['weights']:>8.0f}" if r["weights"] else f"{'-':>8}" for cpu in MCPUS)
        print(f"{r['kernel'][:78] + ' ' + r['at']:<86} {r['insns']:>5} {r['spills']:>6} {r['dot']:>4} {r['tbl']:>4} "
              f"{r['cortex-a76']:>8.1f} {r['cortex-a72']:>8.1f} {per} {kw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
