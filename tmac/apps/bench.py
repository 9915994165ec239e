"""``tmac bench``: kernel benchmarks (GEMV at given shapes) and end-to-end generation benchmarks, against torch
and — when the optional ``peer`` extra (llama-cpp-python) is installed — llama.cpp on the same GGUF file.

Speeds are compared within one run (the machine may be shared); more than one thread is measured only when
the other CPUs are idle (a ``/proc/stat`` load check), and skipped with a note otherwise.
"""

from __future__ import annotations

import importlib.util
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from tmac.base.timing import BUSY_LIMIT, COLD_BYTES, cold_medians, cold_medians_beside_probe, cpu_busy_fraction, \
    median_seconds, read_probe, read_seconds


def bench_group(k: int) -> int:
    """The group size GEMV benchmarks use for K inputs, for tmac and torch int4 alike: 128, else the largest of 64
    and 32 that divides K (BitNet-3B's K = 8640 is a multiple of 64 only)."""
    return next(g for g in (128, 64, 32) if k % g == 0)


def int4pack(w, group: int = 128):
    """Asymmetric 4-bit groups in the layout of torch's ``_weight_int4pack_mm_for_cpu``: (packed, scales_zeros)."""
    import torch

    m, k = w.shape
    g = w.reshape(m, -1, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = (hi - lo).clamp(min=1e-6) / 15
    q = ((g - lo) / s).round().clamp(0, 15).to(torch.int32).reshape(m, k)
    sz = torch.stack([s.reshape(m, -1).t(), (lo + 8 * s).reshape(m, -1).t()], -1).to(torch.bfloat16).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), sz


def int4_linear(x, packed, group: int = 128):
    import torch

    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed[0], group, packed[1])


@dataclass
class Row:
    what: str  # shape or model
    candidate: str
    threads: int
    value: float  # ms per GEMV (kernels) or generated tok/s (end to end)
    extra: dict


def measured_threads(threads_list: list[int], notes: list[str]):
    """Each thread count that may be measured now, set for tmac and torch in turn; a count above 1 is skipped,
    with a note, while other processes keep the CPUs busy."""
    import torch

    import tmac

    from tmac.base.cpu import usable_cpus

    for threads in threads_list:
        if threads > usable_cpus():
            notes.append(f"{threads} threads skipped: this process may use {usable_cpus()} CPUs")
            continue
        busy = cpu_busy_fraction() if threads > 1 else 0.0
        if busy > BUSY_LIMIT:
            notes.append(f"machine busy ({busy:.0%} of CPUs): {threads}-thread numbers skipped")
            continue
        tmac.set_num_threads(threads)
        torch.set_num_threads(threads)
        yield threads


def kernel_bench(shapes, bits_list, threads_list, notes: list[str], progress=None, cold: bool = False) -> list[Row]:
    """GEMV (one activation row, table build included) per shape: tmac at each bit width, torch fp32, bf16 and
    int4 weight-only. Warm: one cache-resident matrix each. ``cold``: weights streamed from DRAM, as in a model
    (``cold_medians``): tmac's layouts timed together with the 1 GiB read probe before each pass (``% probe``),
    torch's each on its own (a cold torch fp32 call slowed the next tmac one up to 1.7x)."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from tmac.execution.lut_ops import LutWeight
    from tmac.base.memory import huge_page_copies
    from tmac.quant.quantize import quantize_weight

    rows = []
    for m, k in shapes:
        w = torch.from_numpy(np.random.default_rng(0).standard_normal((m, k), dtype=np.float32))
        x = torch.randn(1, k)
        xb = x.to(torch.bfloat16)
        group = bench_group(k)

        def floats(tensors, call, nbytes):  # a torch candidate: (weights, call on weights, copies, bytes)
            return tensors, call, lambda n: huge_page_copies(tensors, n), nbytes

        torch_cands = {"torch fp32": floats((w,), lambda c: F.linear(x, c[0]), m * k * 4),
                       "torch bf16": floats((w.to(torch.bfloat16),), lambda c: F.linear(xb, c[0]), m * k * 2)}
        unable = []  # candidates that cannot run this shape: a row of "—", not an aborted benchmark
        try:
            torch_cands["torch int4wo"] = floats(int4pack(w, group), lambda c: int4_linear(xb, c, group),
                                                 m * k // 2 + m * k // group * 4)
        except RuntimeError as e:
            unable.append("torch int4wo")
            notes.append(f"torch int4wo cannot run {m}x{k}: {str(e).splitlines()[0]}")
        lut = {f"tmac W{bits}": LutWeight.from_quantized(quantize_weight(w.numpy(), bits=bits, group_size=group))
               for bits in bits_list}
        for threads in measured_threads(threads_list, notes):
            seconds, extra = {}, {}
            if cold:
                timed, probe_sec = cold_medians_beside_probe([(lw.copies, lambda c: c.matmul(x), lw.nbytes)
                                                              for lw in lut.values()])
                probe_gbs = COLD_BYTES / probe_sec / 1e9
                for (name, lw), sec in zip(lut.items(), timed):
                    seconds[name] = sec
                    extra[name] = {"% probe": 100 * lw.nbytes / sec / 1e9 / probe_gbs}
                for name, (_, call, make, nbytes) in torch_cands.items():
                    seconds[name] = cold_medians([(make, call, nbytes)])[0]
            else:
                for name, (tensors, call, _, _) in torch_cands.items():
                    seconds[name] = median_seconds(lambda: call(tensors))
                for name, lw in lut.items():
                    seconds[name] = median_seconds(lambda: lw.matmul(x))
            nbytes = {name: c[3] for name, c in torch_cands.items()} | {name: lw.nbytes for name, lw in lut.items()}
            for name, sec in seconds.items():
                rows.append(Row(f"{m}x{k}", name, threads, sec * 1e3,
                                {"GB/s": nbytes[name] / sec / 1e9, **extra.get(name, {})}))
                if progress:
                    progress.advance(f"{m}x{k} {name} {threads}t")
            for name in unable:
                rows.append(Row(f"{m}x{k}", name, threads, float("nan"), {}))
                if progress:
                    progress.advance(f"{m}x{k} {name} {threads}t")
    return rows


def e2e_bench(source, variants, threads_list, notes: list[str], prompt_tokens=64, gen_tokens=64, peer=True,
              progress=None, profiles: list | None = None, rounds: int = 3) -> list[Row]:
    """Prefill and decode tok/s of a model loaded as each ``(bits, head_bits)`` of ``variants`` (``bits=None``:
    the file's own weights; ``head_bits``: requantize the output head too), and of llama.cpp on the same GGUF
    file when llama-cpp-python is installed. Every candidate runs ``rounds`` times, the candidates taking turns
    (so a slow stretch of a shared machine hits all of them), and reports its medians; ``% DRAM`` is against the
    read probe timed before every run (its median: ``probe GB/s``), the bandwidth the host lent, and ``ceiling
    tok/s`` what that bandwidth allows (probe / weight bytes a token reads): a ratio to llama.cpp above tmac's
    ceiling over llama.cpp's tok/s cannot be reached in that run. With
    ``profiles``, each variant's decode step at every thread count is broken down by call (``DecodePlan.profile``),
    and its prefill of the prompt by part (``prefill_profile``), into it as ``(label, threads, "decode" or
    "prefill", {part: seconds})``."""
    path = str(source) if source is not None else None
    prompt = [(i * 7919) % 1000 + 100 for i in range(prompt_tokens)]  # fixed ids inside any real vocabulary
    models = [_tmac_candidate(path, bits, head_bits, prompt, gen_tokens) for bits, head_bits in variants]
    path = path or models[0].path
    with_peer = peer and path.endswith(".gguf") and importlib.util.find_spec("llama_cpp") is not None
    if peer and not path.endswith(".gguf"):
        notes.append("llama.cpp not measured: it reads GGUF files only")
    elif peer and not with_peer:
        notes.append("llama.cpp not measured: install the optional peer extra, built for this CPU (5-15 min): "
                     f"{peer_install_command()} (docs/llama-cpp.md)")
    rows, probe = [], read_probe()
    for threads in measured_threads(threads_list, notes):
        candidates = models + ([_llama_cpp_candidate(path, threads, prompt, gen_tokens)] if with_peer else [])
        runs: dict[str, list[tuple[float, float]]] = {c.label: [] for c in candidates}
        probe_gbps = []  # the read probe before every run: the bandwidth the host lent this case
        try:
            for _ in range(rounds):
                for c in candidates:
                    probe_gbps.append(COLD_BYTES / read_seconds(probe) / 1e9)
                    runs[c.label].append(c.run())
        finally:
            for c in candidates:
                c.close()
        dram = statistics.median(probe_gbps)
        for c in candidates:
            tok_s = statistics.median(decode for _, decode in runs[c.label])
            gbps = c.streamed * tok_s / 1e9
            rows.append(Row(path, c.label, threads, tok_s, {
                **c.info, "GB/s": gbps, "% DRAM": 100 * gbps / dram, "probe GB/s": dram,
                "ceiling tok/s": dram * 1e9 / c.streamed,
                "prefill tok/s": statistics.median(prefill for prefill, _ in runs[c.label])}))
            if profiles is not None and c.model is not None:
                profiles.append((c.label, threads, "decode", decode_profile(c.model, prompt[0],
                                                                            prompt_tokens + gen_tokens, notes)))
                profiles.append((c.label, threads, "prefill", prefill_profile(c.model, prompt, notes)))
            if progress:
                progress.advance(f"{c.label} {threads}t")
    return rows


@dataclass
class _Candidate:
    label: str
    path: str
    run: Callable[[], tuple[float, float]]  # a warm-up, then one generation: (prefill tok/s, decode tok/s)
    streamed: int  # weight bytes one decode step reads
    info: dict  # model MiB, size vs fp16
    model: object = None  # the tmac model, for a decode profile
    close: Callable[[], None] = lambda: None  # ends what ``run`` needs (the peer's process)


def _head_label(head) -> str:
    """How a loaded model's head is stored, for a candidate's label: the 8-bit default shows too."""
    from tmac.nn.linear import Linear

    inner = getattr(head, "linear", head)  # a ternary head behind its activation quantization
    return f", head W{inner.format.bits}" if isinstance(inner, Linear) else ", float head"


def _tmac_candidate(path, bits, head_bits, prompt, gen_tokens) -> _Candidate:
    import torch

    from tmac.models.run.generate import Session
    from tmac.models.files.load import default_model_path, load_model
    from tmac.apps.process import own_torch_threads

    path = path or default_model_path()
    model = load_model(path, bits=bits, head_bits=head_bits, context=len(prompt) + gen_tokens + 8, progress=False)
    own_torch_threads(model)  # (as the command line runs it)
    tensors = {t.data_ptr(): t for t in model.state_dict().values() if isinstance(t, torch.Tensor)}  # tied once
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    fp16_size = 2 * sum(p.numel() for p in type(model).skeleton(model.config).parameters())  # tied once

    session = Session(model)

    def run():
        session.generate(prompt, max_tokens=2, ignore_eos=True, temperature=0)  # warm-up: kernels, plans, thread pools
        session.cached_ids = []  # prefill the whole prompt
        session.generate(prompt, max_tokens=gen_tokens, ignore_eos=True, temperature=0)
        s = session.stats
        # decode steps, not tokens (the first comes from the prefill), and the set-up (the plan's key check) with them
        return s["prefill_tokens"] / s["prefill_s"], s["decode_steps"] / (s["setup_s"] + s["decode_s"])

    head = _head_label(model.output) if bits is not None or head_bits is not None else ""
    label = "tmac " + ("file's own" if bits is None else f"W{bits}") + head
    session.generate(prompt[:8], max_tokens=2, ignore_eos=True, temperature=0)  # kernels compile here, before the child
    # measures its peak: compiling there would count TVM (a cold cache added 70-150 MiB to every candidate)
    info = {"model MiB": size / 2**20, "x fp16": size / fp16_size,
            "peak RSS MiB": _process_peak_rss_mib(path, bits, head_bits, prompt, gen_tokens)}
    return _Candidate(label, path, run, streamed_bytes(model), info,
                      model)


def _process_peak_rss_mib(path, bits, head_bits, prompt, gen_tokens) -> float:
    """Peak RSS of a process of its own that loads the model as the candidate does and generates from the prompt
    (this process holds every candidate at once)."""
    import json
    import subprocess
    import sys

    request = json.dumps([path, bits, head_bits, prompt, gen_tokens])
    r = subprocess.run([sys.executable, "-c", "import sys, tmac.apps.bench; tmac.apps.bench.report_peak_rss(sys.argv[1])",
                        request], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"measuring the peak RSS of {path} failed:\n{r.stderr[-2000:]}")
    return float(r.stdout.split()[-1])


def report_peak_rss(request: str) -> None:
    """``_process_peak_rss_mib``'s child: load and generate as ``tmac run`` does, print the peak RSS in MiB."""
    import json

    from tmac.apps.cli_generate import load_for_generation
    from tmac.base.memory import one_malloc_arena, peak_rss_mib
    from tmac.models.run.generate import Session

    one_malloc_arena()  # (as the command line: this is the peak of ``tmac run``)
    path, bits, head_bits, prompt, gen_tokens = json.loads(request)
    model = load_for_generation(path, bits=bits, head_bits=head_bits, context=len(prompt) + gen_tokens + 8,
                                progress=False)
    Session(model).generate(prompt, max_tokens=gen_tokens, ignore_eos=True, temperature=0)
    print(peak_rss_mib())


def decode_profile(model, token: int, pos: int, notes: list[str]) -> dict[str, float]:
    """Seconds per decode step by kind of call, at position ``pos`` ({} when the model decodes eagerly)."""
    import torch

    from tmac.models.run.decode import DecodePlan

    with torch.inference_mode():
        plan = DecodePlan.build(model)
        if plan is None:
            notes.append("no decode profile: this model decodes on the eager path")
            return {}
        return plan.profile(token, pos)


def prefill_profile(model, prompt: list[int], notes: list[str], rounds: int = 3) -> dict[str, float]:
    """Seconds of one prefill of ``prompt`` (a fresh sequence, in ``PREFILL_CHUNK``s as a session runs it) by kind
    of call (``DecodePlan.kind``), from the round that took least, and ``"step"``, the whole ({} when the model
    prefills on the eager path)."""
    import time

    import torch

    from tmac.models.run.decode import Plans
    from tmac.models.run.generate import prefill, prefill_chunks
    from tmac.models.run.sequence import Sequence
    from tmac.apps.process import torch_single_threaded

    plans = Plans(model).current()
    if any(plans.prefill(end - start) is None for start, end in prefill_chunks(0, len(prompt))):
        notes.append("no prefill profile: this model prefills on the eager path")
        return {}
    best, sequence = None, Sequence(model, adopt=False)  # (each round writes the same positions)
    with torch.inference_mode(), torch_single_threaded():
        for _ in range(rounds):
            spent: dict[str, float] = {}
            t0 = time.perf_counter()
            for _ in prefill(model, prompt, sequence, last_only=True, plans=plans, spent=spent):
                pass
            spent["step"] = time.perf_counter() - t0
            if best is None or spent["step"] < best["step"]:
                best = spent
    return best


def profile_rows(spent: dict[str, float], whole: str = "step") -> list[tuple[str, str, str]]:
    """One step's breakdown as table rows: each kind of call, the rest and the whole (``whole``), in ms and
    share; then the serial part, all that does not run on the thread pool (at 1 thread: the serial fraction)."""
    from tmac.execution.runtime import ON_POOL

    step = spent["step"]
    calls = sorted(((k, v) for k, v in spent.items() if k != "step"), key=lambda kv: -kv[1])
    rest = max(step - sum(v for _, v in calls), 0.0)
    serial = step - sum(v for k, v in calls if k.endswith(ON_POOL))
    return [(k, f"{v * 1e3:.2f}", f"{v / step:.1%}") for k, v in [*calls, ("Python loop and the rest", rest)]] + \
        [(whole, f"{step * 1e3:.2f}", "100%"), ("serial: not on the thread pool", f"{serial * 1e3:.2f}",
                                                 f"{serial / step:.1%}")]


def streamed_bytes(model) -> int:
    """Bytes of weights one decode step reads: the layers and the head, not the embedding (one row of it)."""
    tensors = {t.data_ptr(): t for part in (model.layers, model.output) for t in (*part.parameters(), *part.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def gguf_streamed_bytes(path: str) -> int:
    """The same for llama.cpp on a GGUF file: all tensors but the embedding (unless it is the tied head)."""
    from tmac.models.files.gguf_file import GGUFFile

    tensors = GGUFFile(path).tensors
    tied = "output.weight" not in tensors
    return sum(t.data.nbytes for name, t in tensors.items() if tied or name != "token_embd.weight")


def _llama_cpp_candidate(path, threads, prompt, gen_tokens) -> _Candidate:
    """llama.cpp in a process of its own (``tmac/apps/peer_llama_cpp.py``), with the OpenMP settings the user gave."""
    import json
    import os
    import subprocess
    import sys

    from tmac.base.memory import peak_rss_mib
    from tmac.apps.process import user_environment

    env = user_environment()
    script = os.path.join(os.path.dirname(__file__), "peer_llama_cpp.py")
    proc = subprocess.Popen([sys.executable, script, path, str(threads), str(len(prompt) + gen_tokens + 8),
                             str(len(prompt))], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    info = {"model MiB": os.path.getsize(path) / 2**20}

    def run():
        proc.stdin.write(json.dumps({"prompt": prompt, "gen_tokens": gen_tokens}) + "\n")
        proc.stdin.flush()
        answer = proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the llama.cpp peer process for {path} exited with code {proc.wait()} (its "
                               f"error is on stderr above)")
        speeds = json.loads(answer)
        if (rss := peak_rss_mib(proc.pid)) is not None:
            info["peak RSS MiB"] = rss
        return speeds["prefill"], speeds["decode"]

    def close():
        proc.stdin.close()
        proc.wait()

    return _Candidate("llama.cpp (same file)", path, run, gguf_streamed_bytes(path), info, close=close)


# what each extra column of the tables means, printed under a table that has it
COLUMNS = {
    "model MiB": "the weights' bytes in memory",
    "x fp16": "those bytes over a float16 copy's (0.28: 28 % of float16's)",
    "peak RSS MiB": "the process's peak resident memory for one generation, importing torch included",
    "GB/s": "weight bytes decode reads a second (bytes a token x tok/s)",
    "probe GB/s": "this machine's read bandwidth, measured by a plain streaming read beside every run",
    "% DRAM": "GB/s as a share of probe GB/s (100: decode is as fast as the weights can be read)",
    "ceiling tok/s": "the decode speed probe GB/s allows (probe GB/s / bytes a token)",
    "prefill tok/s": "prompt tokens a second",
    "% probe": "the kernel's weight bytes a second as a share of a plain read of as many cold bytes",
}


def table(rows: list[Row], unit: str, baseline: str) -> str:
    """Rows as an aligned text table, with each candidate's ratio to ``baseline`` at the same shape/threads."""
    base = {(r.what, r.threads): r.value for r in rows if r.candidate == baseline}
    keys = sorted({k for r in rows for k in r.extra})
    header = ["", "candidate", "threads", unit, f"vs {baseline}", *keys]
    lines = [header]
    for r in rows:
        b = base.get((r.what, r.threads))
        ratio = (b / r.value if unit == "ms" else r.value / b) if b else float("nan")
        missing = r.value != r.value  # NaN: the candidate cannot run this case
        lines.append([r.what if len(r.what) < 40 else "…" + r.what[-39:], r.candidate, str(r.threads),
                      "—" if missing else f"{r.value:.3f}" if unit == "ms" else f"{r.value:.1f}",
                      "—" if missing or ratio != ratio else f"{ratio:.2f}x",
                      *(_figure(r.extra[k]) if k in r.extra else "" for k in keys)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    legend = [f"  {k}: {COLUMNS[k]}" for k in keys if k in COLUMNS]
    return "\n".join(out + (["", f"vs {baseline}: the ratio to {baseline}'s {unit} in the same run; columns:"]
                             + legend if legend else []))


def _figure(v: float) -> str:
    """One decimal, or three significant digits below 10 (a size ratio of 0.297 must not print as 0.3)."""
    return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"


def plot(rows: list[Row], path: str, ylabel: str) -> None:
    """A grouped bar chart: one group per candidate, one bar per thread count."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib (or the tmac[plot] extra)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    subjects = list(dict.fromkeys(r.what.split("/")[-1] for r in rows))
    one = len(subjects) == 1  # one model or shape: named once, in the title, not under every bar

    def label(r):
        return r.candidate if one else f"{r.candidate}\n{r.what.split('/')[-1]}"

    cands = list(dict.fromkeys(label(r) for r in rows))
    threads = sorted({r.threads for r in rows})
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(cands)), 4))
    if one:
        ax.set_title(subjects[0], fontsize=9)
    width = 0.8 / len(threads)
    for i, t in enumerate(threads):
        values = {label(r): r.value for r in rows if r.threads == t}
        ax.bar([c + i * width for c in range(len(cands))], [values.get(c, 0) for c in cands], width,
               label=f"{t} thread{'s' if t > 1 else ''}")
    ax.set_xticks([c + width * (len(threads) - 1) / 2 for c in range(len(cands))], cands, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def peer_cmake_args(features: frozenset[str], x86: bool = True) -> str:
    """llama.cpp's CMake flags for a CPU with ``features`` (``tmac.base.cpu`` names): each instruction set ON only where
    the CPU has it (a build with one it lacks dies with SIGILL), AMX always OFF (docs/llama-cpp.md)."""
    if not x86:
        return "-DGGML_NATIVE=ON"
    avx512 = "avx512bw" in features
    flags = {"NATIVE": False, "AVX": True, "AVX2": True, "FMA": True, "F16C": True, "AVX512": avx512,
             "AVX512_VBMI": avx512 and "avx512vbmi" in features, "AVX512_VNNI": avx512 and "avx512vnni" in features,
             "AVX512_BF16": avx512 and "avx512bf16" in features, "AVX_VNNI": "avxvnni" in features,
             "AMX_TILE": False, "AMX_INT8": False, "AMX_BF16": False}
    return " ".join(f"-DGGML_{k}={'ON' if v else 'OFF'}" for k, v in flags.items())


def peer_install_command() -> str:
    from tmac.base.cpu import cpu_features, machine_arch

    args = peer_cmake_args(cpu_features(), machine_arch() == "x86_64")
    return f"CMAKE_ARGS=\"{args}\" pip install 'llama-cpp-python>=0.3'"
