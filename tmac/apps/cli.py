"""The ``tmac`` command line. Errors print one line and exit non-zero; ``--debug`` shows the traceback."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import sys
import time
import warnings

from tmac.apps import cli_generate, cli_perplexity
from tmac.base.formats import BITS, GROUP_SIZES, K_MULTIPLE, PER_ROW, PER_TENSOR, WeightFormat, default_group_size, kernels_take
from tmac.base.cpu import ARCH_ALIASES, ARCHES
from tmac.kernels import DEFAULT_ISA, ISAS, target_isa


class Parser(argparse.ArgumentParser):
    """A (sub)command's parser that refuses what it does not know itself, with its own usage and the nearest flag
    (``--temprature``: did you mean ``--temperature``?), instead of the top-level usage's bare complaint."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if self._subparsers is not None:
            _merge_model_flag(self, namespace)
        if extras and self._subparsers is None:
            flags = [s for s in self._option_string_actions if s.startswith("--")]
            word = extras[0].split("=", 1)[0]
            near = difflib.get_close_matches(word, flags, 1, 0.6) if word.startswith("-") else []
            self.error(f"unrecognized argument{'s' if len(extras) > 1 else ''}: {' '.join(extras)}"
                       + (f" (did you mean {near[0]}?)" if near else ""))
        return namespace, extras


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:  # (building the flags imports numpy: a while)
        print("interrupted", file=sys.stderr)
        return 130
    if not args.debug:  # a warning is one line for a person, not a source line of tmac's
        warnings.showwarning = _show_warning
    try:
        from tmac.base.memory import one_malloc_arena
        from tmac.apps.process import freeze_imports, prefer_passive_openmp

        prefer_passive_openmp()  # (the command line owns its process: tmac.apps.process)
        one_malloc_arena()
        if getattr(args, "model", None) and args.func is not cmd_pull:
            from tmac.models.files.hub import resolve

            args.model_name, args.model = args.model, resolve(args.model)
            if args.model != args.model_name:  # a repo id: say which file it gave
                print(f"tmac: {args.model_name}: {_shown_path(args.model)}", file=sys.stderr)
            if not os.path.exists(args.model) and not getattr(args, "shape", None):  # (before torch is imported:
                # said at once; with --shape the two refuse each other first)
                raise FileNotFoundError(f"no such model file or directory: {args.model}")
        if args.func not in (cli_generate.cmd_run, cli_generate.cmd_chat, cli_generate.cmd_serve):
            freeze_imports()  # (those three once torch and the model's modules are imported)
        code = args.func(args) or 0
        _finish_packed_copies()
        return code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        _abandon_packed_copies()
        return 130
    except BrokenPipeError:  # the reader of our output left (| head): quietly, as other tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # (so that the interpreter's last flush does not complain)
        return 141
    except Exception as e:  # one clear line for a person; the traceback only on request
        if args.debug:
            _show_causes(e)
            raise
        print(f"tmac {args.command}: error: {describe(e)}", file=sys.stderr)
        return 1


def _finish_packed_copies() -> None:
    """A first run's packed copy still being written when the command is done: said, then waited for (the process
    would wait for it anyway; a person should know why)."""
    cache = sys.modules.get("tmac.models.files.packed_cache")
    if cache is not None and cache.writing():
        print("tmac: finishing the packed copy of the model for the next runs ...", file=sys.stderr, flush=True)
        cache.wait()


def _abandon_packed_copies() -> None:
    """Interrupted while a packed copy is written: the process ends now, not after the copy (its temporary file is
    removed by the next run that writes one; the interpreter would otherwise wait for the thread, and a second
    Ctrl-C there ends in a traceback)."""
    cache = sys.modules.get("tmac.models.files.packed_cache")
    if cache is not None and cache.writing():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(130)


def _merge_model_flag(parser, args) -> None:
    """``-m/--model MODEL`` (llama.cpp's spelling) as the positional MODEL."""
    flag = getattr(args, "model_flag", None)
    if hasattr(args, "model_flag"):
        del args.model_flag
    if flag is None:
        return
    if getattr(args, "model", None) not in (None, flag):
        parser.error(f"two models given: {args.model} and -m {flag}")
    args.model = flag


def _show_causes(e: BaseException) -> None:
    """Every exception behind ``e`` shown in its traceback: tmac's messages name the file and field and hide the
    error they were made from (``raise … from None``), which is what a person debugging wants to see."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__suppress_context__ = False
        e = e.__cause__ or e.__context__


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"tmac: warning: {message}", file=file or sys.stderr)


def describe(e: Exception) -> str:
    """An error as one line: the message of the errors tmac raises for bad input or a missing part; any other
    exception (a bug, or a case nobody foresaw) with its type, so ``KeyError: 6`` never prints as a bare ``6``."""
    from tmac.base.errors import KernelUnavailableError, ModelFormatError

    if isinstance(e, (ValueError, OSError, ModelFormatError, KernelUnavailableError)) and \
            type(e).__module__.startswith(("builtins", "tmac")) and str(e):
        return str(e)
    if isinstance(e, MemoryError) or isinstance(e, RuntimeError) and "can't allocate memory" in str(e):
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return (f"not enough memory ({first[:200]}): a smaller --context, a smaller model, or fewer requests at "
                f"once need less")
    return f"{type(e).__name__}: {e} (unexpected; run with --debug for the traceback)"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="tmac", description="Low-bit LLM inference on CPUs with table lookups.")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--version", action=_PrintVersion, nargs=0, help="show tmac's version and exit")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-m", "--model", dest="model_flag", metavar="MODEL", default=argparse.SUPPRESS,
                        help="the model (as the positional MODEL)")
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)

    pull = sub.add_parser("pull", parents=[common], help="download a model from the Hugging Face hub into its cache")
    pull.add_argument("model", nargs="?", default=None, metavar="ORG/NAME[:QUANT or :FILE.gguf]",
                      help="a repo id: its GGUF (Q4_K_M where it has several), or its Hugging Face directory's "
                           "config, safetensors and tokenizer; :Q4_K_M picks that quantization, :FILE.gguf one file")
    pull.set_defaults(func=cmd_pull)

    cache = sub.add_parser("cache", parents=[common], help="the packed copies of GGUF files and the kernels tmac "
                                                             "keeps: list them, or clear them")
    cache.add_argument("action", nargs="?", choices=("list", "clear"), default="list")
    cache.add_argument("--models", action="store_true", help="clear: only the packed model copies")
    cache.add_argument("--kernels", action="store_true", help="clear: only the compiled kernels")
    cache.add_argument("--json", action="store_true", help="list: one JSON object instead of the table")
    cache.set_defaults(func=cmd_cache)

    info = sub.add_parser("info", parents=[common], help="CPU features, kernel ISA, threads, versions, kernel cache")
    info.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    info.set_defaults(func=cmd_info)

    c = sub.add_parser("compile", parents=[common],
                       help="compile the kernels a model runs into a directory, for this machine or another arch")
    c.add_argument("--arch", default=None,
                   help=f"target architecture: {', '.join(ARCHES)} (aliases: {', '.join(ARCH_ALIASES)}; "
                        "default: this machine's)")
    c.add_argument("--isa", help="instruction set, as `tmac info` names it: " + ", ".join(ISAS) +
                                 " or generic (default: this CPU's best; for another arch its common one: "
                                 + ", ".join(f"{a} {n}" for a, n in DEFAULT_ISA.items()) + ")")
    c.add_argument("--bits", type=int, choices=BITS,
                   help="weights requantized to this many bits, as `tmac run --bits` (default: the kernels the "
                        "model's own weights load with, e.g. Q4_1 layers and a Q8_0 head)")
    c.add_argument("--group-size", help=f"one of {GROUP_SIZES}, '{PER_ROW}' or '{PER_TENSOR}' (default: as load_model, "
                                        "the largest of 128/64/32 dividing K)")
    c.add_argument("--head-bits", type=cli_generate.head_bits_arg, help="with --model: " + cli_generate.HEAD_BITS_HELP)
    c.add_argument("--symmetric", action="store_true", help="weights without zeros")
    c.add_argument("model", nargs="?", default=None, help="a model as `tmac run` takes it (GGUF file, Hugging "
                                                           "Face, GPTQ or BitNet directory, .tmac file, repo id; "
                                                           "default: SmolLM2-135M-Instruct)")
    c.add_argument("--shape", nargs="+", action="extend", metavar="MxK",
                   help="only the projection kernels of these weight shapes (out x in features; needs --bits; not "
                        "with a model)")
    c.add_argument("-o", "--output", metavar="DIR",
                   help="output directory (default: ./tmac-kernels-<isa>; kernels already there are kept)")
    c.set_defaults(func=cmd_compile)
    cli_generate.add_parsers(sub, common)
    cli_perplexity.add_parser(sub, common)

    t = sub.add_parser("tune", parents=[common], help="grid-search kernel tiling for this machine; later runs use it")
    t.add_argument("--bits", default="1,2,3,4", help="comma-separated bit widths (default 1,2,3,4)")
    t.add_argument("--group-size", default=None, help=f"one of {GROUP_SIZES}, '{PER_ROW}' or '{PER_TENSOR}' (default: "
                                                      "as quantize_model chooses for each K: 128 where it divides K)")
    t.add_argument("--symmetric", action="store_true", help="weights without zeros")
    t.add_argument("--ternary", action="store_true", help="ternary weights instead of --bits (BitNet absmean; "
                                                          "--group-size tensor or row: the triple kernels)")
    t.add_argument("model", nargs="?", default=None, help="a model: tune every kernel it runs as loaded (or --k)")
    t.add_argument("--k", metavar="K", help="comma-separated input sizes, e.g. 4096,11008 (instead of a model)")
    t.set_defaults(func=cmd_tune)

    b = sub.add_parser("bench", parents=[common], help="kernel (--shape) or end-to-end (--e2e, the default) "
                                                      "benchmarks against torch and, when installed, llama.cpp")
    b.add_argument("model", nargs="?", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    b.add_argument("--e2e", action="store_true", help="end-to-end generation of MODEL (what runs without --shape)")
    b.add_argument("--profile", action="store_true", help="end to end: also break one decode step down by call, and "
                                                          "the prompt's prefill by part")
    b.add_argument("--shape", nargs="+", action="extend", metavar="MxK", help="benchmark GEMV kernels at these shapes")
    b.add_argument("--cold", action="store_true", help="kernels: stream the weights from DRAM (1 GiB of copies, as in "
                                                       "a model) instead of one cache-resident matrix")
    b.add_argument("--bits", default=None, help="comma-separated bit widths, for models also 'own': the file's own "
                                                "quantization (default: kernels 1,2,3,4; models own)")
    b.add_argument("--head-bits", type=cli_generate.head_bits_arg, help="with --bits: " + cli_generate.HEAD_BITS_HELP)
    b.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    b.add_argument("--prompt-tokens", type=int, default=64)
    b.add_argument("--gen-tokens", type=int, default=64)
    b.add_argument("--rounds", type=int, default=3, help="end to end: generations per candidate, the candidates "
                                                         "taking turns; the medians are reported (default 3)")
    b.add_argument("--no-peer", action="store_true", help="do not run llama.cpp even if installed")
    b.add_argument("--plot", metavar="PNG", help="write a bar chart (needs matplotlib)")
    b.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    b.set_defaults(func=cmd_bench)
    return p


# ---- info -------------------------------------------------------------------------------------------------------

def cmd_info(args) -> int:
    from tmac.quant import cache
    from tmac.execution import runtime
    from tmac.base.cpu import FEATURES, cpu_features, machine_arch, physical_cores
    from tmac.kernels import ISA_ENV, best_isa
    from tmac.quant.layout import GRID_TYPES

    arch, feats = machine_arch(), cpu_features()
    isa = problem = None
    try:
        isa = best_isa()
    except ValueError as e:
        problem = str(e)
    kernel_dir = os.environ.get("TMAC_KERNEL_DIR") or None
    facts = {
        "tmac": _version("tmac"), "architecture": arch, "simd_features": sorted(feats),
        "kernel_isa": isa.name if isa else None, "kernel_isa_description": isa.description if isa else problem,
        "kernel_isa_from": ISA_ENV if isa and os.environ.get(ISA_ENV, "").strip() else "cpu",
        "threads": runtime.get_num_threads(), "physical_cores": physical_cores(),
        "torch": _version("torch"), "apache_tvm": _version("apache-tvm"), "apache_tvm_ffi": _version("apache-tvm-ffi"),
        "kernel_cache": cache.cache_dir(), "kernel_dir": kernel_dir, "huge_pages": _huge_pages_line(),
        # the grid i-quants the kernels hold as the file's indices and signs (at its size), else as 4-bit codes
        "iquants_at_file_size": sorted(GRID_TYPES) if isa and isa.expands_grids else [],
    }
    if args.json:
        print(json.dumps(facts))
        return 0
    isa_line = f"{isa.name} — {isa.description}" if isa else f"none ({problem})"
    if isa and isa.name.startswith("generic"):
        isa_line += "  [FALLBACK: no table-lookup instructions found; kernels will be slow]"
    if facts["kernel_isa_from"] == ISA_ENV:
        isa_line += f"  (chosen by {ISA_ENV})"
    _print_table([
        ("tmac", facts["tmac"]),
        ("architecture", arch),
        ("SIMD features", "  ".join(f"{f} {'yes' if f in feats else 'no'}" for f in FEATURES)),
        ("kernel ISA", isa_line),
        ("threads", f"{facts['threads']} (physical cores {facts['physical_cores']}; TMAC_NUM_THREADS overrides)"),
        ("torch", facts["torch"]),
        ("apache-tvm", facts["apache_tvm"]),
        ("apache-tvm-ffi", facts["apache_tvm_ffi"]),
        ("kernel cache", facts["kernel_cache"]),
        ("kernel dir", kernel_dir or "(none; set TMAC_KERNEL_DIR)"),
        ("huge pages", facts["huge_pages"]),
        ("i-quants", f"IQ4_NL, IQ4_XS, {', '.join(facts['iquants_at_file_size'])} at the file's size"
         if facts["iquants_at_file_size"] else
         "IQ4_NL, IQ4_XS at the file's size; IQ1-IQ3 as 2- or 4-bit codes, above it (AVX-512 VBMI holds their grids "
         "at it)"),
    ])
    return 0


def _shown_path(path: str) -> str:
    """A hub cache path as a person reads it: the file, and the snapshot's commit."""
    parts = os.path.normpath(path).split(os.sep)
    if "snapshots" in parts:
        at = parts.index("snapshots")
        if at + 1 < len(parts):
            inner = "/".join(parts[at + 2:]) or "(the whole snapshot)"
            return f"{inner} (snapshot {parts[at + 1][:12]})"
    return path


def cmd_cache(args) -> int:
    import shutil

    from tmac.models.files import packed_cache

    root = os.path.dirname(packed_cache.directory())
    kernel_dirs = sorted(os.path.join(root, d) for d in _listdir(root) if d.startswith("tvm-"))
    copies = packed_cache.entries()
    if args.action == "clear":
        both = not args.models and not args.kernels
        gone = packed_cache.clear() if args.models or both else []
        if args.kernels or both:
            for d in kernel_dirs:
                shutil.rmtree(d, ignore_errors=True)
        print(f"removed {len(gone)} packed model cop{'y' if len(gone) == 1 else 'ies'} "
              f"({sum(e['bytes'] for e in gone) / 2**20:.1f} MiB)"
              + (f" and {len(kernel_dirs)} kernel cache director{'y' if len(kernel_dirs) == 1 else 'ies'}"
                 if args.kernels or both else ""))
        return 0
    kernels = [(d, *_tree_size(d)) for d in kernel_dirs]
    if args.json:
        print(json.dumps({"models": copies, "model_directory": packed_cache.directory(),
                          "limit_bytes": packed_cache.limit_bytes(),
                          "kernels": [{"path": d, "files": n, "bytes": b} for d, n, b in kernels]}))
        return 0
    print(f"packed model copies in {packed_cache.directory()} (at most {packed_cache.limit_bytes() / 2**30:.1f} GiB, "
          f"TMAC_MODEL_CACHE_GB; the least recently used go first):")
    if copies:
        _print_table([(_safe(e["source"]), e["isa"], f"{e['bytes'] / 2**20:.1f}",
                       time.strftime("%Y-%m-%d %H:%M", time.localtime(e["used"])) if e["used"] else "?")
                      for e in copies], header=("source", "ISA", "MiB", "last used"))
    else:
        print("  (none)")
    print("compiled kernels:")
    for d, n, b in kernels or [("  (none)", 0, 0)]:
        print(f"  {d}: {n} files, {b / 2**20:.1f} MiB" if n else d)
    print("tmac cache clear removes them all (--models, --kernels: one kind)")
    return 0


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _tree_size(path: str) -> tuple[int, int]:
    n = size = 0
    for d, _, names in os.walk(path):
        for f in names:
            try:
                size += os.lstat(os.path.join(d, f)).st_size
                n += 1
            except OSError:
                pass
    return n, size


def _safe(text: str) -> str:
    """A name from a file or directory, printable: control characters escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def cmd_pull(args) -> int:
    from tmac.models.files.hub import CachedOnly, is_repo_id, pull

    if args.model is None:
        raise ValueError("name the repo: tmac pull ORG/NAME[:QUANT or FILE.gguf]")
    if not is_repo_id(args.model):
        raise ValueError(f"{args.model!r} is not a Hugging Face repo id (ORG/NAME, ORG/NAME:QUANT or "
                         f"ORG/NAME:FILE.gguf)")
    try:
        path = pull(args.model)
    except CachedOnly as e:
        if args.debug:
            raise
        print(f"{args.model} is in the cache: {_shown_path(e.path)} — {e.path}\n(the hub cannot be reached: "
              f"{e.why}; it was not checked for a newer version)\nrun it: tmac run {args.model} -p \"Hello\"")
        return 0
    from tmac.models.files.hub import offline

    where = " (in the cache; HF_HUB_OFFLINE is set, so the hub was not asked for a newer version)" if offline() else ""
    print(f"{args.model}: {_shown_path(path)} — {path}{where}\nrun it: tmac run {args.model} -p \"Hello\"")
    return 0


def _huge_pages_line() -> str:
    from tmac.base.memory import huge_page_mode

    mode = huge_page_mode()
    if mode in ("always", "madvise"):
        return f"THP {mode}: packed weights get 2 MiB pages"
    return (f"THP {mode}: weights stay in 4 KiB pages (a few % slower to stream; Linux: "
            "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled)")


class _PrintVersion(argparse.Action):
    """``--version``: read when asked for (``importlib.metadata`` costs a run's start 15 ms)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"tmac {_version('tmac')}")
        parser.exit()


def _version(dist: str) -> str:
    from importlib import metadata  # (here: a run's start does without it)

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
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


def cmd_compile(args) -> int:
    from tmac.quant import cache
    from tmac.codegen.link import find_linker
    from tmac.base.files import check_room
    from tmac.execution.runtime import KERNEL_ROOM, build_into

    isa = target_isa(args.arch, args.isa)
    linker = find_linker(isa.arch)  # fail at once, saying how to get one, when nothing can link for the target
    if args.shape:
        if args.model:
            raise ValueError("give a model or --shape, not both")
        if args.head_bits is not None:
            raise ValueError("--head-bits is for models (--model), not --shape")
        specs = list(dict.fromkeys(_shape_specs(args, isa)))
    else:
        from tmac.models.run.kernel_specs import model_kernel_specs
        from tmac.models.files.load import default_model_path

        path = args.model or default_model_path()
        group = parse_group_size(args.group_size) if args.group_size else None
        specs = model_kernel_specs(path, isa, bits=args.bits, group_size=group, symmetric=args.symmetric,
                                   head_bits=args.head_bits)
        if not specs:
            raise ValueError(f"{path}: every projection is float; nothing to compile (give --bits to quantize)")
    output = args.output or f"tmac-kernels-{isa.name}"
    done = cache.read_manifest_for_update(output, isa)  # refuses a directory of another ISA before compiling
    check_room(output, KERNEL_ROOM)
    rows, listed = [], len(done)
    for i, spec in enumerate(specs, 1):
        path = os.path.join(output, spec.name + ".so")
        if spec.name in done and _whole(path, isa, done[spec.name]):  # (an earlier compile's, stopped or not)
            rows.append((spec.name, getattr(spec, "k", "-"), getattr(spec, "bits", "-"),
                         getattr(spec, "group_size", "-"), "kept", os.path.getsize(path)))
            continue
        print(f"[{i}/{len(specs)}] compiling {spec.name} ({linker.name}) ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        # the manifest lists each kernel once it is whole: a compile stopped half-way keeps what it finished
        listed = cache.add_to_manifest(output, isa, {spec.name: build_into(spec, isa, path)})
        rows.append((spec.name, getattr(spec, "k", "-"), getattr(spec, "bits", "-"), getattr(spec, "group_size", "-"),
                     f"{time.perf_counter() - t0:.2f}", os.path.getsize(path)))
    _print_table(rows, header=("kernel", "K", "bits", "group", "seconds", "bytes"))
    kept = sum(r[4] == "kept" for r in rows)
    print(f"wrote {len(rows) - kept} kernel(s){f', kept {kept}' if kept else ''} to {os.path.abspath(output)} "
          f"({isa.arch}, {isa.name}; manifest.json lists "
          f"{listed})")
    print(_compile_next_step(args, isa, output))
    return 0


def _whole(path: str, isa, entry: dict) -> bool:
    """Whether ``path`` is the kernel its manifest entry records (size and sha256)."""
    from tmac.quant import cache

    try:
        cache.check_entry(path, isa.arch, entry, "the manifest")
        return True
    except Exception:
        return False


def _compile_next_step(args, isa, output: str) -> str:
    """The command that runs what was compiled, with the options that chose the kernels."""
    from tmac.base.cpu import machine_arch

    run = ["tmac", "run"] + ([getattr(args, "model_name", args.model)] if args.model else [])
    for flag, value in (("--bits", args.bits), ("--group-size", args.group_size), ("--head-bits", args.head_bits)):
        if value is not None and not args.shape:
            run += [flag, str(value)]
    run += ["-p", '"Hello"']
    if isa.arch == machine_arch():
        return f"use them: TMAC_KERNEL_DIR={os.path.abspath(output)} {' '.join(run)}"
    return (f"copy {output} to the {isa.arch} machine (scp -r {output} HOST:), then there: "
            f"TMAC_KERNEL_DIR=~/{os.path.basename(os.path.abspath(output))} {' '.join(run)}"
            + (" (with the model file at the same path there)" if args.model else ""))


def _shape_specs(args, isa):
    from tmac.base.formats import default_group_size
    from tmac.quant.choose import fitting_block_rows, spec_for_format

    if args.bits is None:
        raise ValueError("--shape needs --bits (only a model has weights of its own to take the formats from)")
    group = parse_group_size(args.group_size) if args.group_size else None
    for m, k in sorted({parse_shape(s) for s in args.shape}):
        # (where no group size divides K, 32 makes the spec's own check name K)
        fmt = WeightFormat.rtn(args.bits, group or default_group_size(k) or 32, args.symmetric)
        yield fitting_block_rows(spec_for_format(fmt, k, isa), m, fmt, isa, {})


# ---- tune ----------------------------------------------------------------------------------------------------------

def tune_work(args) -> list:
    """The (format, K) pairs ``tmac tune`` times: a model's, or --bits × --k with each K's group size."""
    if args.model and args.k:
        raise ValueError("give a model or --k, not both")
    if not args.model and not args.k:
        raise ValueError("give a model (tmac tune MODEL) or --k K[,K...]")
    if args.model:
        from tmac.kernels import best_isa
        from tmac.models.run.kernel_specs import model_formats

        work = model_formats(args.model, best_isa())
        if not work:
            raise ValueError(f"{args.model}: every projection is float; nothing to tune")
        return work
    work = []
    for k in _int_list(args.k, "--k"):
        group = parse_group_size(args.group_size) if args.group_size else default_group_size(k)
        if group is None:
            raise ValueError(f"--k {k}: no group size divides it; give --group-size {PER_ROW}")
        work += [(WeightFormat.ternary_format(group), k)] if args.ternary else \
            [(WeightFormat.rtn(b, group, args.symmetric), k) for b in _int_list(args.bits, "--bits", BITS)]
    return work


def cmd_tune(args) -> int:
    from tmac.nn import tuning
    from tmac.quant.choose import tuning_file
    from tmac.kernels import best_isa
    from tmac.quant.choose import spec_for_format
    from tmac.base.progress import Progress

    isa = best_isa()
    work = tune_work(args)
    rows = []
    for i, (fmt, k) in enumerate(work, 1):
        defaults = spec_for_format(fmt, k, isa, unroll=0)  # a tiling argument: the defaults, not earlier tuning
        with Progress(f"[{i}/{len(work)}] tuning {fmt.name} K={k}", tuning.kernels_timed(defaults), True) as bar:
            best, measured = tuning.tune(fmt, k, isa, progress=bar)
        # the last time of each tiling: the default's and the winner's then come from the same pass
        gemv = {(t["block_rows"], t["unroll"], t["k_chunk"]): sec for t, sec in measured["gemv"]}
        rows.append((fmt.name, k, best["block_rows"], best["unroll"], best["k_chunk"], best["n_tile"],
                     f"{gemv[(defaults.block_rows, defaults.unroll, defaults.k_chunk)] * 1e3:.3f}",
                     f"{gemv[(best['block_rows'], best['unroll'], best['k_chunk'])] * 1e3:.3f}"))
    _print_table(rows, header=("format", "K", "block_rows", "unroll", "k_chunk", "n_tile", "default GEMV ms (cold)",
                               "tuned GEMV ms (cold)"))
    print(f"saved to {tuning_file()}; later kernels for these parameters use it")
    return 0


# ---- bench ---------------------------------------------------------------------------------------------------------

def _int_list(text: str, what: str, allowed=None) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{what} takes comma-separated integers, got {text!r}") from None
    bad = [v for v in values if v < 1 or (allowed is not None and v not in allowed)]
    if not values or bad:
        raise ValueError(f"{what}: invalid value(s) {bad or text!r}" + (f"; allowed: {allowed}" if allowed else ""))
    return values


def cmd_bench(args) -> int:
    from tmac.apps import bench
    from tmac.base.progress import Progress

    threads = _int_list(args.threads, "--threads")
    notes: list[str] = []
    profiles = [] if args.profile else None
    if args.shape:
        if args.model or args.e2e or args.profile:
            raise ValueError("give either MODEL/--e2e/--profile (end-to-end) or --shape (kernels), not both")
        shapes = [parse_shape(s) for s in args.shape]
        for (_, k), text in zip(shapes, args.shape):
            if not kernels_take(k):
                raise ValueError(f"--shape {text}: K={k} must be a multiple of {K_MULTIPLE}")
        bits = _int_list(args.bits or "1,2,3,4", "--bits", BITS)
        total = len(shapes) * len(threads) * (len(bits) + 3)
        with Progress("benchmarking kernels", total, True) as bar:
            rows = bench.kernel_bench(shapes, bits, threads, notes, bar, args.cold)
        unit, baseline, ylabel = "ms", "torch fp32", "ms per GEMV (lower is better)"
    else:
        if args.cold:
            raise ValueError("--cold is for kernel benchmarks: give --shape")
        bits = list(dict.fromkeys(None if b == "own" else _int_list(b, "--bits", BITS)[0]
                                  for b in (args.bits or "own").split(",")))
        for n, name, least in ((args.prompt_tokens, "--prompt-tokens", 8), (args.gen_tokens, "--gen-tokens", 8),
                               (args.rounds, "--rounds", 1)):
            if n < least:
                raise ValueError(f"{name} must be >= {least}, got {n}")
        with Progress("benchmarking generation", len(bits) * len(threads) + len(threads), True) as bar:
            variants = [(b, args.head_bits if b else None) for b in bits]
            rows = bench.e2e_bench(args.model, variants, threads, notes, args.prompt_tokens, args.gen_tokens,
                                   not args.no_peer, bar, profiles, args.rounds)
        unit, baseline, ylabel = "tok/s", rows[0].candidate if rows else "", "generated tokens/s (higher is better)"
    if args.json:
        print(json.dumps({"unit": unit, "notes": notes, "rows": [dataclasses.asdict(r) for r in rows],
                          "profiles": [{"candidate": c, "threads": t, "phase": phase, "seconds": p}
                                       for c, t, phase, p in profiles or []]}))
    else:
        print(bench.table(rows, unit, baseline))
        for candidate, t, phase, spent in profiles or []:
            if spent:
                print()
                title = f"{candidate}, {t} thread{'s' if t > 1 else ''}, {phase}"
                _print_table(bench.profile_rows(spent, phase),
                             header=(title, "ms/token" if phase == "decode" else "ms", "share"))
        for note in dict.fromkeys(notes):
            print(f"note: {note}")
    if args.plot:
        bench.plot(rows, args.plot, ylabel)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
