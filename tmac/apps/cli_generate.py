"""``tmac run`` and ``tmac chat``: generate text from a model, streaming tokens as they come."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import threading
import time

from tmac.base.formats import BITS, GROUP_SIZES
from tmac.base.glue import KV_DTYPES
from tmac.apps.serve_http import MAX_CONNECTIONS, REQUEST_TIMEOUT


def add_parsers(sub, common) -> None:
    r = sub.add_parser("run", parents=[common], help="generate text from a prompt")
    _model_args(r)
    r.add_argument("--prompt", "-p", help="the prompt text (default, or -: read it from standard input)")
    r.add_argument("--file", "-f", metavar="FILE", help="read the prompt from FILE (-: standard input)")
    r.add_argument("--json", action="store_true", help="print one JSON object (text, ids, speeds) instead")
    r.set_defaults(func=cmd_run)

    v = sub.add_parser("convert", parents=[common], help="write a pre-packed .tmac model file")
    v.add_argument("model", nargs="?", default=None, help="GGUF file, Hugging Face directory or repo id")
    v.add_argument("--bits", type=int, choices=BITS,
                   help="requantize the projections (default: keep the file's exact quantization)")
    v.add_argument("--group-size", type=int, choices=GROUP_SIZES, help="group size with --bits")
    v.add_argument("--head-bits", type=head_bits_arg, help=HEAD_BITS_HELP)
    v.add_argument("-o", "--output", required=True, metavar="OUT.tmac")
    v.add_argument("--shared-table", action="store_true",
                   help="store a tied token table once, as the head: a smaller file, but loading it unpacks the "
                        "table into memory (by default the table stays in the mapped file)")
    v.add_argument("--arch", default=None,
                   help="pack for another architecture's CPU (arm64, x86_64): a Raspberry Pi's file made in seconds "
                        "on a laptop (default: this machine's)")
    v.add_argument("--isa", help="pack for this instruction set, as `tmac info` names it (default: this CPU's best; "
                                 "with --arch, that architecture's common one); another CPU repacks the file at "
                                 "every load")
    v.add_argument("--json", action="store_true", help="print one JSON object (sizes by part, time) instead")
    v.set_defaults(func=cmd_convert)

    c = sub.add_parser("chat", parents=[common], help="interactive multi-turn chat (/reset, /exit; Ctrl-C stops "
                                                      "an answer)")
    _model_args(c)
    c.set_defaults(func=cmd_chat, chat=True)

    s = sub.add_parser("serve", parents=[common], help="an OpenAI-compatible HTTP API (chat and completions, "
                                                       "streamed or whole), requests batched continuously")
    _load_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    s.add_argument("--port", type=int, default=8080, help="(default: 8080)")
    s.add_argument("--api-key", default=os.environ.get("TMAC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/ (default: $TMAC_API_KEY, else none)")
    s.add_argument("--max-body", type=int, default=8 << 20, metavar="BYTES",
                   help="the largest request body; larger ones get 413 (default: 8 MiB)")
    s.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT, metavar="SECONDS",
                   help="a request must arrive whole (headers and body) within this, else 408 and the connection "
                        f"is closed (default: {REQUEST_TIMEOUT:g})")
    s.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS, metavar="N",
                   help=f"connections held at once; more get 503 and are closed (default: {MAX_CONNECTIONS})")
    s.add_argument("--ray", action="store_true",
                   help="serve on Ray Serve: --replicas copies of the model, each with its own batcher, behind one "
                        "address; a conversation goes to the replica holding its prefix (pip install 'tmac[cluster]'; "
                        "the cluster is $RAY_ADDRESS's, else a local one)")
    s.add_argument("--replicas", type=int, default=2, help="with --ray: replicas, each on --threads CPUs (default: 2)")
    s.add_argument("--min-replicas", type=int, help="with --ray: autoscale between this and --max-replicas")
    s.add_argument("--max-replicas", type=int, help="with --ray: the most replicas autoscaling starts")
    s.add_argument("--alias", "-a", help="the model's name in the API (default: the file's name without .gguf)")
    s.add_argument("--max-batch", type=int, default=4, help="requests generated together at most (default: 4)")
    s.add_argument("--max-queue", type=int, default=16,
                   help="requests waiting beyond those at most; more get 503 (default: 16)")
    s.set_defaults(func=cmd_serve)


MODEL_HELP = ("a GGUF file, a Hugging Face directory, a .tmac file (tmac convert), or a Hugging Face repo id "
              "(ORG/NAME; ORG/NAME:Q4_K_M for its GGUF of that quantization, ORG/NAME:FILE.gguf for one file; "
              "downloaded once into the Hugging Face "
              "cache, see tmac pull) (default: SmolLM2-135M-Instruct Q4_1)")
HEAD_BITS_HELP = (f"the output head: {', '.join(map(str, BITS))} bits, or float (default: the file's own; with --bits, "
                  "8 bits in Q8_0's layout)")


def head_bits_arg(text: str) -> int | str:
    if text == "float":
        return text
    if text in map(str, BITS):
        return int(text)
    raise argparse.ArgumentTypeError(f"expected one of {', '.join(map(str, BITS))} or float, got {text!r}")


def _load_args(p) -> None:
    p.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    p.add_argument("--bits", type=int, choices=BITS, help="requantize the projections to this many bits")
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, help="group size with --bits")
    p.add_argument("--head-bits", type=head_bits_arg, help=HEAD_BITS_HELP)
    p.add_argument("--threads", "-t", type=int, help="kernel and torch threads (default: physical cores)")
    p.add_argument("-c", "--context", type=int, help="context size in tokens (default: the model's, at most 4096)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="float16", help="KV cache dtype (default: float16)")
    p.add_argument("--no-mmap", dest="mmap", action="store_false",
                   help="read the model into memory instead of mapping it: the process cannot be killed by the file "
                        "being truncated or overwritten in place while it runs, at the cost of a slower start and "
                        "pages of its own (by default a .tmac file or packed copy is mapped, its pages shared)")


def _model_args(p) -> None:
    _load_args(p)
    add_sampling_args(p)
    p.add_argument("--system", help="system message for the chat template")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the model's chat template (default: when the model has one)")


def add_sampling_args(p) -> None:
    """A flag per ``SamplingParams`` option, named after it (``--top-k``) with its aliases and llama.cpp's spellings
    (``-n``, ``--temp``, ``--repetition-penalty``), its default and help from its field."""
    from tmac.models.run.sampling import OPTIONS, described

    group = p.add_argument_group("sampling (the defaults are llama.cpp's; --temperature 0 is greedy)")
    for name, f in OPTIONS.items():
        meta = f.metadata
        if not meta["cli"]:
            continue
        flags = [f"--{name.replace('_', '-')}", *(f"--{a.replace('_', '-')}" for a in meta["aliases"]),
                 *meta["flags"]]
        flags = sorted(dict.fromkeys(flags), key=lambda f: f.startswith("--"))  # (short ones first, as argparse's)
        kind = meta["kind"]
        if kind == "bool":
            group.add_argument(*flags, dest=name, action="store_true", default=None, help=described(name))
        elif kind == "stops":
            group.add_argument(*flags, dest=name, action="append", default=None, metavar="TEXT", help=described(name))
        elif kind == "bias":
            group.add_argument(*flags, dest=name, action="append", default=None, metavar="ID=BIAS",
                               type=_bias_arg, help=described(name))
        else:
            group.add_argument(*flags, dest=name, type=float if kind == "float" else int, default=None,
                               metavar="N", help=described(name))


def _bias_arg(text: str) -> tuple[int, float]:
    """``ID=BIAS``, or llama.cpp's ``ID+BIAS`` / ``ID-BIAS``."""
    match = re.fullmatch(r"\s*(\d+)\s*([=+-])\s*([0-9.eE+-]+|inf)\s*", text)
    try:
        token, sign, bias = match.groups()
        return int(token), float(bias) * (-1.0 if sign == "-" else 1.0)
    except (AttributeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (e.g. 15043=-100), got {text!r}") from None


def sampling_params(args):
    """The ``SamplingParams`` the command line's flags give (the defaults where none is given)."""
    from tmac.models.run.sampling import OPTIONS, SamplingParams

    given = {name: getattr(args, name) for name in OPTIONS if getattr(args, name, None) is not None}
    if "logit_bias" in given:
        given["logit_bias"] = dict(given["logit_bias"])
    return SamplingParams(**given)


def load_for_generation(source, copy_behind: bool = False, **options):
    """``tmac.load_model(source, **options)`` as the command line loads (``copy_behind``: a first run's packed copy
    written while it generates, as ``tmac run`` and ``tmac serve`` do): torch on one thread meanwhile (the
    loader's work is numpy's and the kernel pool's; torch's own workers would only take memory), then on one for a
    model with LUT layers and on as many as the kernels for a float one (``tmac.apps.process``: the command line owns
    its process)."""
    import torch

    import tmac
    from tmac.models.files import load  # noqa: F401  (imported here: its time is the import's, not the load's)
    from tmac.apps.process import freeze_what_loading_made, own_torch_threads

    torch.set_num_threads(1)
    model = None
    try:
        model = tmac.load_model(source, compile_ahead=True, copy_behind=copy_behind, **options)
    finally:
        own_torch_threads(model, otherwise=tmac.get_num_threads())
    freeze_what_loading_made()
    return model


def check_load_args(args) -> None:
    """The load's options, checked before anything heavy is imported (an error in well under a second)."""
    if args.group_size is not None and args.bits is None:
        raise ValueError("--group-size needs --bits (the file's own quantization is used otherwise)")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.context is not None and args.context < 1:
        raise ValueError(f"--context must be a positive number of tokens, got {args.context}")


@contextlib.contextmanager
def _ctrl_c_held():
    """Ctrl-C held until the block is done, then raised: in ``import torch`` a KeyboardInterrupt raised inside its C++
    start-up aborts the process (pybind11 turns it into std::terminate) instead of ending it with "interrupted"."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hit = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: hit.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if hit:
        raise KeyboardInterrupt


def _load(args):
    check_load_args(args)
    with _ctrl_c_held():
        import torch  # noqa: F401  (the import's time is said apart from the load's)

    import tmac
    from tmac.models.run import generate  # noqa: F401
    from tmac.models.files import load, packed_cache  # noqa: F401
    from tmac.base.timing import process_seconds
    from tmac.apps.process import freeze_imports

    freeze_imports()

    if args.threads is not None:
        tmac.set_num_threads(args.threads)  # (at most the CPUs this process may use)
    args.import_s = process_seconds()  # since the process started: the interpreter, tmac, numpy, torch
    t0 = time.perf_counter()
    model = load_for_generation(args.model, copy_behind=True, bits=args.bits, group_size=args.group_size,
                                head_bits=args.head_bits, context=args.context, kv_dtype=args.kv_dtype,
                                mmap=getattr(args, "mmap", True))
    args.packed_copy = model.packed_copy
    args.packing_copy = packed_cache.writing()  # (a first run's, written behind it for the next)
    load_s = time.perf_counter() - t0
    if model.tokenizer is None:
        raise ValueError(f"{model.source}: the model has no tokenizer (tokenizer.json), so it cannot take text")
    print(f"tmac: {precision_line(model, args.bits)}", file=sys.stderr)
    return model, load_s


def precision_line(model, bits: int | None) -> str:
    """What precision runs, in one line, and what to add where it is likely not what the user wants: float weights
    (slow), a quantized file requantized (lossy), 2 bits or fewer on a model not made for them (nonsense)."""
    from tmac.base.float_linear import FloatLinear
    from tmac.nn.linear import Linear

    kinds = set()
    for layer in model.layers:
        for m in layer.modules():
            if isinstance(m, Linear):
                kinds.add("ternary" if m.format.ternary else f"{m.format.bits}-bit")
            elif isinstance(m, FloatLinear):
                kinds.add(str(m.weight.dtype).removeprefix("torch."))
    what = "/".join(sorted(kinds))
    if all(k.startswith(("float", "bfloat")) for k in kinds):
        return (f"running the float weights as they are ({what}): slow; --bits 4 quantizes them (about 8x "
                f"faster decode, a little quality lost)")
    source = getattr(model, "file_quantization", None) or _file_quantization(model.source)
    if bits is None:
        return f"running the file's {source} weights exactly" if source else f"running {what} weights"
    line = f"running weights requantized to {bits} bits"
    if source:
        line += f" from the file's {source}: quality drops (tmac perplexity shows how much); without --bits the " \
                f"file's own weights run exactly"
    if bits <= 2 and model.config.arch != "bitnet":
        line += f"; {bits} bits suit only models trained for them (BitNet b1.58, 2-bit GPTQ): expect nonsense text"
    return line


def _file_quantization(path: str) -> str | None:
    """A GGUF's projections' quantization (``Q4_1``; a mix: its types), None for float weights or another file —
    for models loaded without it (``model.file_quantization``: packed copies written by older versions)."""
    from tmac.models.files.gguf_file import GGUFFile, projection_types

    if not str(path).endswith(".gguf"):
        return None
    try:
        return projection_types(GGUFFile(path).tensors)
    except Exception:  # (it loaded: anything odd here only loses the note)
        return None


def _prompt_ids(model, args, messages: list[dict]) -> list[int]:
    from tmac.models.text.stream import prompt_ids

    return prompt_ids(model.tokenizer, messages, model.context, args.chat, args.system)


def fit_context(model, args, params, messages: list[dict]) -> tuple[list[int], int]:
    """``tmac.models.text.stream.fit_conversation`` with the command's options (room for ``max_tokens``, or a quarter of
    the context where it is not given)."""
    from tmac.models.text.stream import fit_conversation

    room = params.max_tokens if params.max_tokens is not None else model.context // 4
    return fit_conversation(model.tokenizer, messages, model.context, room, args.chat, args.system)


class Interrupted(Exception):
    """Ctrl-C during generation: stop after the current token, keeping what was generated."""


class CtrlCStops:
    """While active, Ctrl-C only sets a flag that the streamer checks after each token, so generation stops
    between tokens, never inside a kernel call or a half-updated KV cache; a second Ctrl-C interrupts at once."""

    def __enter__(self):
        self.hit = False
        self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._old)


def stream_answer(session, ids: list[int], params, out, first: list | None = None) -> bool:
    """Generate from ``ids``, writing the text to ``out`` (None: nowhere) as it comes; Ctrl-C stops after the
    current token, keeping what was said. Whether it was interrupted. ``first``: gets the seconds from the process's
    start to the first token."""
    from tmac.base.timing import process_seconds

    def check(token):
        if first is not None and not first:
            first.append(process_seconds())
        if ctrl_c.hit:
            raise Interrupted

    with CtrlCStops() as ctrl_c:
        try:
            for piece in session.generate(ids, params, stream=True, text=True, callback=check):
                _write(out, piece)
            return False
        except (Interrupted, KeyboardInterrupt):
            session.stats["stop_reason"] = "interrupted"
            if session.last is not None:
                _write(out, session.last.close())
            return True


def _write(out, piece: str) -> None:
    if out is not None and piece:
        out.write(piece)
        out.flush()


def _stats(session, load_s: float, args=None, first_token_s: float | None = None) -> dict:
    """The run's figures; with ``args`` (the first answer of a process) its start-up whole: ``import_s`` (the
    interpreter, tmac and torch, from the process's start), ``load_s``, ``setup_s`` (plans and kernels), and
    ``first_token_s``, from the process's start to the first token."""
    from tmac.base.memory import peak_rss_mib

    s = session.stats
    out = {"prompt_tokens": s["prompt_tokens"], "prefill_tokens": s["prefill_tokens"],
           "prompt_tokens_per_s": s["prefill_tokens"] / s["prefill_s"] if s["prefill_s"] else 0.0,
           "generated_tokens": s["generated_tokens"],
           "gen_tokens_per_s": s["decode_steps"] / s["decode_s"] if s["decode_steps"] else 0.0,
           "load_s": load_s, "setup_s": s["setup_s"], "peak_rss_mib": peak_rss_mib(),
           "stop_reason": s["stop_reason"]}
    if args is not None:
        out.update(import_s=getattr(args, "import_s", 0.0), first_token_s=first_token_s,
                   packed_copy=bool(getattr(args, "packed_copy", False)),
                   packing_copy=bool(getattr(args, "packing_copy", False)))
    return out


def _stats_line(st: dict) -> str:
    line = (f"prompt: {st['prompt_tokens']} tokens ({st['prefill_tokens']} prefilled) at "
            f"{st['prompt_tokens_per_s']:.1f} tok/s | generated: {st['generated_tokens']} tokens at "
            f"{st['gen_tokens_per_s']:.1f} tok/s | ")
    if st.get("first_token_s") is not None:
        copy = " (packed copy)" if st.get("packed_copy") else " (packing a copy meanwhile)" if st.get("packing_copy") \
            else ""
        line += (f"start-up: import {st['import_s']:.2f} s, load {st['load_s']:.2f} s{copy}, kernels "
                 f"{st['setup_s']:.2f} s, first token at "
                 f"{st['first_token_s']:.2f} s | ")
    else:
        line += f"load {st['load_s']:.2f} s, setup {st['setup_s']:.2f} s | "
    return line + f"peak RSS {st['peak_rss_mib']:.0f} MiB"


def read_prompt(args) -> str:
    """The prompt: ``-p TEXT``, ``-f FILE``, or standard input where neither is given or the text is ``-``."""
    if args.prompt is not None and args.file is not None:
        raise ValueError("give the prompt as -p TEXT or -f FILE, not both")
    if args.file is not None:
        if args.file == "-":
            return sys.stdin.read()
        try:
            with open(args.file, encoding="utf-8") as f:
                return f.read()
        except UnicodeDecodeError as e:
            raise ValueError(f"{args.file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if args.prompt is not None and args.prompt != "-":
        return args.prompt
    if sys.stdin is None or sys.stdin.closed or (args.prompt is None and sys.stdin.isatty()):
        raise ValueError("no prompt: give -p TEXT, -f FILE, or pipe it in (echo TEXT | tmac run)")
    return sys.stdin.read()


def _recorded(args):
    """The model stepped from its packed copy's plan recipe, without importing torch (``tmac.models.run.recipe``),
    and the seconds its load took; None where the run needs torch: options that bypass the packed copy, a source
    that is neither a GGUF nor a ``.tmac`` file, or no current recipe yet (the run then writes one)."""
    if not _takes_recipes(args) or not getattr(args, "mmap", True):
        return None
    from tmac.models.files import packed_cache
    from tmac.models.files.hub import default_model_path, resolve

    if not packed_cache.enabled():
        return None
    path = resolve(args.model) if args.model else default_model_path()
    if not os.path.isfile(path):
        return None
    key, copy, at = _recipe_place(path)
    if copy is None:
        return None
    from tmac.base.timing import process_seconds
    from tmac.models.run import recipe

    if args.threads is not None:
        from tmac.execution import runtime

        runtime.set_num_threads(args.threads)
    args.import_s = process_seconds()
    t0 = time.perf_counter()
    from tmac.base.errors import ModelFormatError

    try:
        model = recipe.read(recipe.path_for(at, args.context, args.kv_dtype), copy,
                            recipe.key(copy, args.context, args.kv_dtype))
    except ModelFormatError:  # a damaged copy: the torch path's load says so, removes it and packs it again
        return None
    if model is None:
        return None
    if key is not None:
        packed_cache.touch(key)
    model.source = path  # (as a load from the copy says: the file the user named)
    args.packed_copy, args.packing_copy = True, False
    quantization = model.file_quantization
    print(f"tmac: running the file's {quantization} weights exactly" if quantization else
          "tmac: running the file's own weights exactly", file=sys.stderr)
    return model, time.perf_counter() - t0


# the load options whose packed copy a run without them uses (``load_model``'s defaults)
PACKED_OPTIONS = dict(bits=None, group_size=None, symmetric=False, head_bits=None)


def _takes_recipes(args) -> bool:
    """Whether this run's model is one a plan recipe holds: the file's own weights (no option that bypasses its
    packed copy), recipes not turned off (``TMAC_RECIPES=0``)."""
    return args.bits is None and args.group_size is None and args.head_bits is None and \
        os.environ.get("TMAC_RECIPES", "1") != "0"


def _recipe_place(path: str) -> tuple[str | None, str | None, str | None]:
    """For a model file: the packed copy's key (a GGUF's), the ``.tmac`` file a run maps (the copy, or the file
    itself), and the path its recipes are named after (the copy's; a converted file's own key in the cache, not
    beside the user's file); Nones where there is none."""
    from tmac.models.files import packed_cache
    from tmac.models.files.hub import is_gguf

    if is_gguf(path):
        key, copy = packed_cache.lookup(path, PACKED_OPTIONS)
        return key, copy, copy
    if path.endswith(".tmac"):
        mark = packed_cache.key_of(packed_cache.identity(path), {"converted": True})
        return None, path, os.path.join(packed_cache.directory(), mark + ".tmac")
    return None, None, None


def _record(model, session, args) -> None:
    """After a run with torch from a GGUF's packed copy (or one written behind it) or a ``.tmac`` file: write its plan
    recipe, so that the next run needs no torch. Quietly nothing where it cannot be written."""
    import warnings

    from tmac.models.files import packed_cache
    from tmac.models.run import recipe

    if not _takes_recipes(args):
        return
    if packed_cache.writing():  # (a first run's copy, written behind it: said, as the command's end says it)
        print("tmac: finishing the packed copy of the model for the next runs ...", file=sys.stderr, flush=True)
        packed_cache.wait()
    source = getattr(model, "source", None)
    if not packed_cache.enabled() or not isinstance(source, str) or not os.path.isfile(source):
        return
    _, copy, at = _recipe_place(source)
    if not copy or not os.path.isfile(copy):
        return
    try:
        os.makedirs(os.path.dirname(at), mode=0o700, exist_ok=True)
        recipe.record_run(model, session, copy, args.context, at)
    except OSError as e:  # (a full or read-only cache: the next run takes torch again)
        warnings.warn(f"could not write the plan recipe of {copy} ({e})", stacklevel=2)


def _model_and_session(args):
    """The model, its load's seconds, a ``Session`` over it, and whether it runs from a plan recipe (no torch)."""
    from tmac.models.run.generate import Session

    recorded = _recorded(args)
    if recorded is not None:
        model, load_s = recorded
        return model, load_s, Session(model, plans=model.plans, sequence=model.sequence), True
    model, load_s = _load(args)
    return model, load_s, Session(model), False


def cmd_run(args) -> int:
    prompt = read_prompt(args)
    if not prompt.strip():
        raise ValueError("the prompt is empty")
    params = sampling_params(args)
    check_load_args(args)
    model, load_s, session, recorded = _model_and_session(args)
    ids = _prompt_ids(model, args, [{"role": "user", "content": prompt}])
    first: list = []
    interrupted = stream_answer(session, ids, params, None if args.json else sys.stdout, first)
    text = session.last.text.text() if session.last is not None else ""
    st = _stats(session, load_s, args, first[0] if first else None)
    if args.json:
        print(json.dumps({"text": text, "prompt_ids": ids, "generated_ids": list(session.last.ids), **st,
                          "torch": not recorded}))
    else:
        print()
        print(_stats_line(st), file=sys.stderr)
    if not recorded and not interrupted:
        _record(model, session, args)
    return 130 if interrupted else 0


def cmd_convert(args) -> int:
    from tmac.models.files.convert import convert

    if args.group_size is not None and args.bits is None:
        raise ValueError("--group-size needs --bits")
    isa = None
    if args.arch or args.isa:
        from tmac.kernels import target_isa

        isa = target_isa(args.arch, args.isa)
    done = convert(args.model, args.output, bits=args.bits, group_size=args.group_size, head_bits=args.head_bits,
                   shared_table=args.shared_table, isa=isa.name if isa else None)
    if args.json:
        print(json.dumps(done))
        return 0
    mib = {k: v / 2**20 for k, v in done["bytes"].items()}
    rows = [("source", getattr(args, "model_name", None) or args.model or done["source"]), ("output", args.output),
            ("quantized layers", f"{done['quantized_layers']} ({', '.join(done['formats']) or 'none'})" +
             ("; the weights stay float (slow to run): --bits 4 quantizes them" if not done["quantized_layers"]
              else "")),
            ("file size", f"{done['file_bytes'] / 2**20:.1f} MiB (source {done['source_bytes'] / 2**20:.1f} MiB): "
                          + ", ".join(f"{k} {v:.1f}" + (" (the head's, shared)" if k == "token table" and
                                                       done["table_from_head"] else "") for k, v in mib.items())),
            ("packed for", done["isa"] + ("" if done["kernels_compiled"] else
                                          f" (its kernels compile on that CPU's first run, or here: `tmac compile "
                                          f"--isa {done['isa']} --model {args.output} -o DIR`)")),
            ("time", f"{done['seconds']:.1f} s")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


CHAT_COMMANDS = {"/help": "this list", "/reset": "start the conversation over", "/exit": "quit (also /bye, /quit, "
                 "Ctrl-D)"}
CHAT_QUIT = ("/exit", "/bye", "/quit")


def cmd_chat(args) -> int:
    if sys.stdin is None or sys.stdin.closed:
        raise ValueError("tmac chat reads its messages from standard input, which is closed; for one prompt use "
                         "tmac run -p TEXT")
    params = sampling_params(args)
    check_load_args(args)
    model, load_s, session, recorded = _model_and_session(args)
    print(f"tmac chat: {model.source} loaded in {load_s:.1f} s. /help lists the commands, /exit quits, Ctrl-C "
          f"stops an answer.", file=sys.stderr)
    _converse(model, session, args, params, load_s)
    if not recorded and session.last is not None:  # (a conversation with torch: the next one starts without)
        _record(model, session, args)
    return 0


def _converse(model, session, args, params, load_s: float) -> None:
    """``tmac chat``'s turns, until end of input or /exit."""
    interactive = sys.stdin.isatty()
    messages: list[dict] = []
    while True:
        line = _read_line("> " if interactive else "")
        if line is None:
            return
        command = line.strip()
        if command in CHAT_QUIT:
            return
        if command == "/help":
            print("\n".join(f"  {k:<7} {v}" for k, v in CHAT_COMMANDS.items()), file=sys.stderr)
            continue
        if command == "/reset":
            messages = []
            session.reset()
            print("(conversation reset)", file=sys.stderr)
            continue
        if command.startswith("/") and " " not in command:
            print(f"unknown command {command}; /help lists them (a message starting with / : add a space after "
                  f"the word)", file=sys.stderr)
            continue
        if not command:
            continue
        messages.append({"role": "user", "content": line})
        try:
            answered = _chat_turn(model, session, args, params, messages)
        except KeyboardInterrupt:  # before the answer began: the conversation goes on without this message
            answered = False
            print("\n(interrupted)", file=sys.stderr)
        except ValueError as e:
            answered = False
            print(f"error: {e}", file=sys.stderr)
        if not answered:
            messages.pop()
            continue
        print()
        print(_stats_line(_stats(session, load_s)), file=sys.stderr)


def _read_line(prompt: str) -> str | None:
    """A line from standard input (after ``prompt`` on a terminal; none when piped, so that a piped chat's output
    is the answers alone), None at its end (Ctrl-D) or on Ctrl-C while waiting."""
    try:
        if prompt:  # a terminal: line editing
            return input(prompt)
        line = sys.stdin.readline()
    except (EOFError, KeyboardInterrupt, RuntimeError, ValueError):  # (RuntimeError, ValueError: stdin closed)
        print(file=sys.stderr)
        return None
    return line.rstrip("\n") if line else None


def _chat_turn(model, session, args, params, messages: list[dict]) -> bool:
    """Answer the last user message, streaming; Ctrl-C during the answer stops it and keeps what was said."""
    ids, dropped = fit_context(model, args, params, messages)
    if dropped:
        print(f"(context full: dropped the {dropped} oldest exchange{'s' if dropped > 1 else ''})", file=sys.stderr)
    stream_answer(session, ids, params, sys.stdout)
    messages.append({"role": "assistant", "content": session.last.text.text()})
    return True


def cmd_serve(args) -> int:
    from tmac.apps.serve_http import check_api_key, check_limits

    # the options first, before FastAPI and torch are imported: a wrong one is said at once
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.max_body < 1024:
        raise ValueError(f"--max-body must be at least 1024 bytes, got {args.max_body}")
    check_limits(args.request_timeout, args.max_connections)
    check_api_key(args.api_key)
    check_load_args(args)
    check_port_free(args.host, args.port)  # before loading: a busy port is said at once
    try:
        import uvicorn  # noqa: F401  (said here, before loading, where it is missing)

        from tmac.apps.serve import Served, create_app, log_line, model_name
        from tmac.apps.serve_http import server_config
    except ImportError as e:
        raise ValueError(f"tmac serve needs FastAPI and uvicorn ({e}); pip install fastapi uvicorn") from None
    if args.ray:
        from tmac.apps.process import freeze_imports

        freeze_imports()  # (the model loads in the replicas)
        return _serve_on_ray(args)
    if (warning := open_bind_warning(args.host, args.api_key)) is not None:
        print(warning, file=sys.stderr)
    model, _ = _load(args)
    given = getattr(args, "model_name", None)
    served = Served(args.alias or model_name(model.source), given, os.path.basename(model.source),
                    model_name(model.source))
    app = create_app(model, served, args.api_key, args.max_batch, args.max_queue, log=log_line,
                     max_body=args.max_body)
    if app.state.batcher.max_caches < args.max_batch:
        print(f"tmac serve: KV caches of {model.context} positions for {app.state.batcher.max_caches} requests fit "
              f"in memory, not --max-batch {args.max_batch}: the others wait (503 past --max-queue)", file=sys.stderr)
    config = server_config(app, args.host, args.port, args.request_timeout, args.max_connections,
                           log_level="warning", access_log=False, timeout_graceful_shutdown=1)
    server = _Server(config, app.state.shutdown)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"tmac: serving {served.name} at http://{host}:{args.port}/v1 (OpenAI API; context {model.context} tokens, "
          f"up to {args.max_batch} requests at once{', API key required' if args.api_key else ''}); Ctrl-C stops",
          file=sys.stderr)
    server.run()
    return 0


def _serve_on_ray(args) -> int:
    """``tmac serve --ray``: the app deployed on Ray Serve (``tmac.apps.cluster``) until SIGINT or SIGTERM."""
    try:
        import ray
        from ray import serve

        from tmac.apps.cluster import APP_NAME, deployment
    except ImportError as e:
        raise ValueError(f"tmac serve --ray needs Ray Serve ({e}): pip install 'tmac[cluster]'") from None
    app = deployment(args.model, replicas=args.replicas, threads=args.threads or 1, context=args.context,
                     max_batch=args.max_batch, max_queue=args.max_queue, alias=args.alias, api_key=args.api_key,
                     max_body=args.max_body, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                     mmap=args.mmap)
    address = os.environ.get("RAY_ADDRESS")
    print(f"tmac serve: {'joining the Ray cluster at ' + address if address else 'starting a local Ray cluster'}",
          file=sys.stderr, flush=True)
    ray.init(address=address or "local", include_dashboard=False, logging_level="warning", log_to_driver=False)
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name=APP_NAME, route_prefix="/")
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"tmac: serving at http://{host}:{args.port}/v1 on Ray Serve ({args.replicas} replicas of "
              f"{args.threads or 1} thread{'s' if (args.threads or 1) > 1 else ''}); Ctrl-C stops", file=sys.stderr,
              flush=True)
        while not stop:
            time.sleep(0.2)
        print("tmac serve: shutting down", file=sys.stderr, flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


class _Server:
    """uvicorn's server, stopping as a container expects: the first SIGINT or SIGTERM ends every running
    generation at once (a stream gets its last chunk, finish reason ``abort``), closes the connections within a
    second and exits 0; a second exits at once."""

    def __init__(self, config, shutdown):
        import uvicorn

        outer = self

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                outer.stop(self, sig)

        self.server, self.shutdown, self.stopping = Server(config), shutdown, False

    def stop(self, server, sig) -> None:
        if self.stopping:
            print("tmac serve: stopped", file=sys.stderr, flush=True)
            os._exit(130 if sig == signal.SIGINT else 143)
        self.stopping = True
        print("tmac serve: shutting down", file=sys.stderr, flush=True)
        self.shutdown()
        server.should_exit = True

    def run(self) -> None:
        self.server.run()


def open_bind_warning(host: str, api_key: str | None) -> str | None:
    """What to say when the server listens beyond this machine with no key."""
    if _loopback(host) or api_key:
        return None
    return (f"tmac serve: warning: listening on {host} without --api-key: anyone who can reach this machine can use "
            f"the model")


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_port_free(host: str, port: int) -> None:
    """``ValueError`` where ``host:port`` cannot be listened on (taken, or no such address)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror} (another server there? --port N picks "
                             f"another)") from None
