"""Instructions per token on arm64 without a board: tmac and llama.cpp run as aarch64 code under qemu-aarch64 with
a plugin that counts every executed guest instruction (bench/arm64/count_insns.c), for a Cortex-A76 (Raspberry
Pi 5) and a Cortex-A72 (Pi 4), one thread each, on the same GGUF files.

    python bench/arm64_counts.py FILE... [--cpu cortex-a76 cortex-a72] [--llama-bench CPU=PATH ...] [--json]

Per decoded token: (the run generating 32 tokens - the run generating 16) / 16, after a 1-token prompt. Per prompt
token: (a 64-token prompt - a 32-token prompt) / 32, one token generated. Loading, start-up and warm-up cancel in
the differences. tmac's count is split by where the instructions ran (the process's memory map): LUT kernels,
glue kernels (the decode step's fused kernels), Python, torch, other (libc, numpy, tvm-ffi, the loader); llama.cpp
(`llama-bench -r 1 --no-warmup -t 1`, a static aarch64 build: docs/performance.md says how) is split by symbol into
its matrix kernels (ggml_vec_dot_*, ggml_gemv_*, ggml_gemm_*) and the rest.

tmac's file is packed and its kernels cross-compiled on this machine (`tmac convert --isa`, `tmac compile --isa
--model`), as for a Pi; the aarch64 Python is the one `make test-arm64` builds (tests/arm64/environment.py).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "arm64"))
CPUS = {"cortex-a76": "neon_dotprod", "cortex-a72": "neon"}
DECODE = (16, 32)
PREFILL = (32, 64)
# an assumption, stated wherever the estimate is: instructions per cycle of the code outside the kernels (Python,
# torch, libc: branchy scalar code) on each core
OTHER_IPC = {"cortex-a76": 1.0, "cortex-a72": 0.7}
MATRIX_SYMBOLS = re.compile(r"^(ggml_vec_dot_|ggml_gemv_|ggml_gemm_|ggml_compute_forward_mul_mat)")


def plugin(build: str) -> str:
    """The counting plugin, built for this host."""
    so = os.path.join(build, "count_insns.so")
    source = os.path.join(HERE, "arm64", "count_insns.c")
    if not os.path.exists(so) or os.path.getmtime(so) < os.path.getmtime(source):
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise SystemExit("a C compiler (cc) is needed to build the qemu plugin")
        subprocess.run([cc, "-shared", "-fPIC", "-O2", "-fvisibility=hidden", "-o", so, source], check=True)
    return so


def read_counts(path: str) -> list[tuple[int, int, int]]:
    """(block address, its instructions, its executions) of each line the plugin wrote."""
    out = []
    with open(path) as f:
        for line in f:
            vaddr, insns, runs = line.split()
            out.append((int(vaddr, 16), int(insns), int(runs)))
    return out


def read_maps(path: str) -> list[tuple[int, int, str]]:
    regions = []
    with open(path) as f:
        for line in f:
            parts = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            regions.append((start, end, parts[5].strip() if len(parts) > 5 else "", int(parts[2], 16)))
    return sorted(regions)


def tmac_part(path: str) -> str:
    name = os.path.basename(path)
    if name.startswith("lut_"):
        return "LUT kernels"
    if name.startswith("glue_"):
        return "glue kernels"
    if "libpython" in name or re.search(r"/python3(\.\d+)?$", path):
        return "Python"
    if "torch" in path or name.startswith("libc10"):
        return "torch"
    return "other"


def split_by_regions(counts, regions, part) -> dict[str, int]:
    starts = [r[0] for r in regions]
    out: dict[str, int] = {}
    for vaddr, insns, runs in counts:
        i = bisect.bisect_right(starts, vaddr) - 1
        name = part(regions[i][2]) if i >= 0 and vaddr < regions[i][1] else "other"
        out[name] = out.get(name, 0) + insns * runs
    return out


def kernel_blocks(counts, regions) -> dict[tuple[str, int, int], int]:
    """(kernel library, block address in it, its instructions) → executions, for tmac's kernels."""
    starts = [r[0] for r in regions]
    out: dict[tuple[str, int, int], int] = {}
    for vaddr, insns, runs in counts:
        i = bisect.bisect_right(starts, vaddr) - 1
        if i < 0 or vaddr >= regions[i][1] or tmac_part(regions[i][2]) not in ("LUT kernels", "glue kernels"):
            continue
        path = regions[i][2]
        base = min(r[0] - r[3] for r in regions if r[2] == path)  # (where the library's address 0 lies)
        key = (path, vaddr - base, insns)
        out[key] = out.get(key, 0) + runs
    return out


def symbols(binary: str) -> tuple[list[int], list[tuple[int, int, str]]]:
    nm = shutil.which("aarch64-linux-gnu-nm") or "nm"
    text = subprocess.run([nm, "-S", "--defined-only", binary], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2] in "tTwW":
            rows.append((int(parts[0], 16), int(parts[0], 16) + int(parts[1], 16), parts[3]))
    rows.sort()
    return [r[0] for r in rows], rows


def llama_part(counts, table, binary: str) -> dict:
    starts, rows = table
    out: dict = {"matrix kernels": 0, "other": 0, "_kernel_blocks": {}}
    for vaddr, insns, runs in counts:
        i = bisect.bisect_right(starts, vaddr) - 1
        hit = i >= 0 and vaddr < rows[i][1] and MATRIX_SYMBOLS.match(rows[i][2])
        out["matrix kernels" if hit else "other"] += insns * runs
        if hit:
            key = (binary, vaddr, insns)
            out["_kernel_blocks"][key] = out["_kernel_blocks"].get(key, 0) + runs
    return out


def run_tmac(cpu: str, model: str, prompt: int, gen: int, so: str, work: str, kernels: str) -> dict[str, int]:
    import environment

    counts, maps = os.path.join(work, "counts.txt"), os.path.join(work, "maps.txt")
    env = {"TMAC_KERNEL_DIR": kernels, "TMAC_CACHE_DIR": os.path.join(work, "cache"), "TMAC_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1"}
    cmd = environment.qemu_python(cpu, env)
    cmd[1:1] = ["-plugin", f"{so},out={counts}"]
    r = subprocess.run([*cmd, os.path.join(HERE, "arm64", "guest_tmac.py"), model, str(prompt), str(gen), maps],
                       capture_output=True, text=True, env={**os.environ, "PATH": os.path.join(environment.ROOT,
                                                                                               "usr", "bin")})
    if r.returncode:
        raise SystemExit(f"tmac under qemu ({cpu}) exited {r.returncode}:\n{r.stderr[-3000:]}")
    blocks, regions = read_counts(counts), read_maps(maps)
    parts = split_by_regions(blocks, regions, tmac_part)
    parts["_kernel_blocks"] = kernel_blocks(blocks, regions)
    return parts


def run_llama(binary: str, cpu: str, model: str, prompt: int, gen: int, so: str, work: str) -> dict[str, int]:
    counts = os.path.join(work, "counts.txt")
    qemu = shutil.which("qemu-aarch64") or "qemu-aarch64"
    r = subprocess.run([qemu, "-cpu", cpu, "-plugin", f"{so},out={counts}", binary, "-m", model, "-p", str(prompt),
                        "-n", str(gen), "-t", "1", "-r", "1", "--no-warmup", "-o", "json"], capture_output=True,
                       text=True)
    if r.returncode:
        raise SystemExit(f"llama-bench under qemu ({cpu}) exited {r.returncode}:\n{r.stderr[-3000:]}")
    return llama_part(read_counts(counts), symbols(binary), binary)


_CYCLES: dict = {}


def block_cycles(path: str, addr: int, insns: int, mcpu: str) -> float:
    """llvm-mca's cycles for one execution of the ``insns`` instructions at ``addr`` of ``path``."""
    key = (path, addr, insns, mcpu)
    if key not in _CYCLES:
        from arm64_mca import functions_range, mca

        try:
            _CYCLES[key] = mca(functions_range(path, addr, addr + 4 * insns), mcpu) if insns else 0.0
        except RuntimeError:  # an instruction llvm-mca does not model: the block at OTHER_IPC
            _CYCLES[key] = insns / OTHER_IPC[mcpu]
    return _CYCLES[key]


def estimate(row: dict, phase: str, mcpu: str) -> float:
    """Cycles per token: the kernels' blocks at llvm-mca's cycles, every other instruction at ``OTHER_IPC``."""
    counts = row[phase]
    kernel = sum(runs * block_cycles(path, addr, insns, mcpu)
                 for (path, addr, insns), runs in counts.get("_kernel_blocks", {}).items() if runs > 0)
    kernel_insns = sum(runs * insns for (_, _, insns), runs in counts.get("_kernel_blocks", {}).items() if runs > 0)
    other = sum(v for k, v in counts.items() if k[0] != "_") - kernel_insns
    return kernel + max(other, 0) / OTHER_IPC[mcpu]


def per_token(low: dict, high: dict, tokens: int) -> dict:
    """What one more token costs: the two runs' difference over ``tokens``, part by part (and kernel block by
    block, under ``_kernel_blocks``)."""
    out = {k: (high.get(k, 0) - low.get(k, 0)) / tokens for k in sorted(set(low) | set(high)) if k[0] != "_"}
    if "_kernel_blocks" in high:
        lo, hi = low.get("_kernel_blocks", {}), high["_kernel_blocks"]
        out["_kernel_blocks"] = {k: (hi.get(k, 0) - lo.get(k, 0)) / tokens for k in set(lo) | set(hi)}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--cpu", nargs="+", default=list(CPUS), choices=list(CPUS))
    p.add_argument("--llama-bench", action="append", default=[], metavar="CPU=PATH",
                   help="an aarch64 llama-bench for that CPU (repeatable)")
    p.add_argument("--engine", nargs="+", default=["tmac", "llama.cpp"], choices=["tmac", "llama.cpp"])
    p.add_argument("--work", default=None, help="where kernels, counts and the packed copies go (default: a temp dir)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    peers = dict(item.split("=", 1) for item in args.llama_bench)
    if "tmac" in args.engine:  # the aarch64 Python's tmac is this checkout as it is now, not as it was last time
        import environment

        environment.main()
    work = args.work or tempfile.mkdtemp(prefix="arm64-counts-")
    os.makedirs(work, exist_ok=True)
    so = plugin(work)
    rows = []
    for model in args.models:
        for cpu in args.cpu:
            kernels = os.path.join(work, f"kernels-{CPUS[cpu]}")
            if "tmac" in args.engine:
                rows.append(done(measure_tmac(model, cpu, so, work, kernels)))
            if cpu in peers and "llama.cpp" in args.engine:
                print(f"{os.path.basename(model)} on {cpu}: llama.cpp ...", file=sys.stderr, flush=True)
                runs = {key: run_llama(peers[cpu], cpu, model, prompt, gen, so, work)
                        for key, (prompt, gen) in {"d0": (0, DECODE[0]), "d1": (0, DECODE[1]), "p0": (PREFILL[0], 0),
                                                   "p1": (PREFILL[1], 0)}.items()}
                rows.append(done({"file": os.path.basename(model), "cpu": cpu, "engine": "llama.cpp",
                                  "file_bytes": os.path.getsize(model),
                                  "decode": per_token(runs["d0"], runs["d1"], DECODE[1] - DECODE[0]),
                                  "prefill": per_token(runs["p0"], runs["p1"], PREFILL[1] - PREFILL[0])}))
    return report(rows, args.json)


def measure_tmac(model: str, cpu: str, so: str, work: str, kernels: str) -> dict:
    # packed and compiled here (`tmac convert --isa`: seconds, where packing under emulation takes many minutes); the
    # runs map the packed file, as a Pi runs one made on a laptop
    packed = os.path.join(work, f"{os.path.splitext(os.path.basename(model))[0]}-{CPUS[cpu]}.tmac")
    for args in (["convert", model, "--isa", CPUS[cpu], "-o", packed],
                 ["compile", "--isa", CPUS[cpu], "--model", packed, "-o", kernels]):
        subprocess.run([sys.executable, "-m", "tmac.apps.cli", *args], check=True, capture_output=True)
    print(f"{os.path.basename(model)} on {cpu}: tmac ...", file=sys.stderr, flush=True)
    # a first run writes what later runs find in the cache (the kernel generator's digest): not a token's work
    run_tmac(cpu, packed, 1, 1, so, work, kernels)
    runs = {key: run_tmac(cpu, packed, prompt, gen, so, work, kernels)
            for key, (prompt, gen) in {"d0": (1, DECODE[0]), "d1": (1, DECODE[1]), "p0": (PREFILL[0], 1),
                                       "p1": (PREFILL[1], 1)}.items()}
    return {"file": os.path.basename(model), "cpu": cpu, "engine": "tmac", "file_bytes": os.path.getsize(model),
            "decode": per_token(runs["d0"], runs["d1"], DECODE[1] - DECODE[0]),
            "prefill": per_token(runs["p0"], runs["p1"], PREFILL[1] - PREFILL[0])}


def done(row: dict) -> dict:
    """``row`` with its board estimate, said at once on standard error (a long campaign keeps what it measured)."""
    row["estimate"] = board_estimate(row, row["file_bytes"])
    print(json.dumps(_plain(row)), file=sys.stderr, flush=True)
    return row


def _plain(row: dict) -> dict:
    return {k: v for k, v in row.items()} | {p: {k: v for k, v in row[p].items() if k[0] != "_"}
                                             for p in ("decode", "prefill")}


def report(rows: list[dict], as_json: bool) -> int:
    if as_json:
        print(json.dumps([_plain(r) for r in rows]))
        return 0
    print(f"{'file':<30} {'cpu':<11} {'engine':<9} {'decode Minsn/tok':>16} {'prefill Minsn/tok':>17} "
          f"{'est. Mcycles/tok':>16} {'est. tok/s':>10} {f'{CORES} cores':>8}  decode split (Minsn)")
    for r in rows:
        d = sum(v for k, v in r["decode"].items() if k[0] != "_") / 1e6
        pf = sum(v for k, v in r["prefill"].items() if k[0] != "_") / 1e6
        parts = sorted(((k, v) for k, v in r["decode"].items() if k[0] != "_"), key=lambda kv: -kv[1])
        e = r["estimate"]
        print(f"{r['file'][:30]:<30} {r['cpu']:<11} {r['engine']:<9} {d:>16.1f} {pf:>17.1f} "
              f"{e['cycles'] / 1e6:>16.1f} {e['tok_s']:>10.1f} {e['tok_s_all_cores']:>8.1f}  " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in parts))
    return 0


# the boards: a Raspberry Pi 5 (4 Cortex-A76 at 2.4 GHz, LPDDR4X-4267 on a 32-bit bus) and a Pi 4 (4 Cortex-A72 at
# 1.8 GHz, LPDDR4-3200 on a 32-bit bus): their published clocks and peak DRAM bandwidths
BOARDS = {"cortex-a76": ("Raspberry Pi 5", 2.4e9, 17.1e9), "cortex-a72": ("Raspberry Pi 4", 1.8e9, 12.8e9)}
CORES = 4  # both boards'; the all-core figure assumes the cores scale perfectly until DRAM caps them (an upper bound)


def board_estimate(row: dict, weight_bytes: int) -> dict:
    """Decode tok/s on one core of the row's board: its clock over the estimated cycles per token, capped by
    streaming ``weight_bytes`` a token at the board's peak DRAM bandwidth; and on its four cores, scaling perfectly
    under the same cap (an upper bound)."""
    board, clock, bandwidth = BOARDS[row["cpu"]]
    cycles = estimate(row, "decode", row["cpu"])
    return {"board": board, "cycles": cycles, "compute_tok_s": clock / cycles,
            "bandwidth_tok_s": bandwidth / weight_bytes, "tok_s": min(clock / cycles, bandwidth / weight_bytes),
            "tok_s_all_cores": min(CORES * clock / cycles, bandwidth / weight_bytes)}


if __name__ == "__main__":
    sys.exit(main())
