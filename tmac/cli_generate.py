"""``tmac run`` and ``tmac chat``: generate text from a model, streaming tokens as they come."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from .formats import BITS, GROUP_SIZES
from .glue import KV_DTYPES


def add_parsers(sub, common) -> None:
    r = sub.add_parser("run", parents=[common], help="generate text from a prompt")
    _model_args(r)
    r.add_argument("--prompt", "-p", required=True, help="the prompt text")
    r.add_argument("--json", action="store_true", help="print one JSON object (text, ids, speeds) instead")
    r.set_defaults(func=cmd_run)

    v = sub.add_parser("convert", parents=[common], help="write a pre-packed .tmac model file")
    v.add_argument("model", help="GGUF file or Hugging Face directory")
    v.add_argument("--bits", type=int, choices=BITS,
                   help="requantize the projections (default: keep the file's exact quantization)")
    v.add_argument("--group-size", type=int, choices=GROUP_SIZES, help="group size with --bits")
    v.add_argument("--head-bits", type=head_bits_arg, help=HEAD_BITS_HELP)
    v.add_argument("-o", "--output", required=True, metavar="OUT.tmac")
    v.add_argument("--shared-table", action="store_true",
                   help="store a tied token table once, as the head: a smaller file, but loading it unpacks the "
                        "table into memory (by default the table stays in the mapped file)")
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
    s.add_argument("--max-batch", type=int, default=4, help="requests generated together at most (default: 4)")
    s.add_argument("--max-queue", type=int, default=16,
                   help="requests waiting beyond those at most; more get 503 (default: 16)")
    s.set_defaults(func=cmd_serve)


MODEL_HELP = ("a GGUF file, a Hugging Face directory, a .tmac file (tmac convert), or a Hugging Face repo id "
              "(ORG/NAME, or ORG/NAME:FILE.gguf for one GGUF of a repo; downloaded once into the Hugging Face "
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
    p.add_argument("--context", type=int, help="context size in tokens (default: the model's, at most 4096)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="float16", help="KV cache dtype (default: float16)")


def _model_args(p) -> None:
    _load_args(p)
    p.add_argument("--max-new-tokens", "-n", type=int, default=256, help="tokens to generate at most (default: 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (default: 0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: 1.0 = off)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="(default: 1.0 = off)")
    p.add_argument("--seed", type=int, help="for sampling (default: a random one)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate all --max-new-tokens tokens, past the end-of-text token (for benchmarks)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop when TEXT appears (repeatable)")
    p.add_argument("--system", help="system message for the chat template")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the model's chat template (default: when the model has one)")


def load_for_generation(source, **options):
    """``tmac.load_model(source, **options)`` as the command line loads: torch on one thread meanwhile (the
    loader's work is numpy's and the kernel pool's; torch's own workers would only take memory), then on as many as
    the kernels, for whatever the model runs eagerly."""
    import torch

    import tmac

    torch.set_num_threads(1)
    try:
        return tmac.load_model(source, **options)
    finally:
        torch.set_num_threads(tmac.get_num_threads())


def _load(args):
    import tmac

    if args.group_size is not None and args.bits is None:
        raise ValueError("--group-size needs --bits (the file's own quantization is used otherwise)")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        tmac.set_num_threads(args.threads)  # (at most the CPUs this process may use)
    t0 = time.perf_counter()
    model = load_for_generation(args.model, bits=args.bits, group_size=args.group_size, head_bits=args.head_bits,
                                context=args.context, kv_dtype=args.kv_dtype)
    if model.tokenizer is None:
        raise ValueError(f"{model.source}: the model has no tokenizer (tokenizer.json), so it cannot take text")
    return model, time.perf_counter() - t0


def _sampling(args) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                repetition_penalty=args.repeat_penalty, seed=args.seed, stop=tuple(args.stop),
                stop_on_eos=not args.ignore_eos)


def _prompt_ids(model, args, messages: list[dict]) -> list[int]:
    from .models.text import prompt_ids

    return prompt_ids(model.tokenizer, messages, model.context, args.chat, args.system)


def fit_context(model, args, messages: list[dict]) -> tuple[list[int], int]:
    """``tmac.models.text.fit_conversation`` with the command's options."""
    from .models.text import fit_conversation

    return fit_conversation(model.tokenizer, messages, model.context, args.max_new_tokens, args.chat, args.system)


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


class Streamer:
    """Prints the text of generated ids as it becomes final (``tmac.models.text.TextStream``); stops on Ctrl-C."""

    def __init__(self, tokenizer, stop: tuple[str, ...], out=None, ctrl_c: CtrlCStops | None = None):
        from .models.text import TextStream

        self.stream, self.out, self.ctrl_c = TextStream(tokenizer, stop), out, ctrl_c

    @property
    def ids(self) -> list[int]:
        return self.stream.ids

    def _write(self, piece: str) -> None:
        if self.out is not None and piece:
            self.out.write(piece)
            self.out.flush()

    def __call__(self, token: int) -> None:
        self._write(self.stream.push(token))
        if self.ctrl_c is not None and self.ctrl_c.hit:
            raise Interrupted

    def finish(self) -> str:
        self._write(self.stream.finish())
        return self.stream.text()


def _stats(session, load_s: float) -> dict:
    from .memory import peak_rss_mib

    s = session.stats
    return {"prompt_tokens": s["prompt_tokens"], "prefill_tokens": s["prefill_tokens"],
            "prompt_tokens_per_s": s["prefill_tokens"] / s["prefill_s"] if s["prefill_s"] else 0.0,
            "generated_tokens": s["generated_tokens"],
            "gen_tokens_per_s": s["decode_steps"] / s["decode_s"] if s["decode_steps"] else 0.0,
            "load_s": load_s, "setup_s": s["setup_s"], "peak_rss_mb": peak_rss_mib(),
            "stop_reason": s["stop_reason"]}


def _stats_line(st: dict) -> str:
    return (f"prompt: {st['prompt_tokens']} tokens ({st['prefill_tokens']} prefilled) at "
            f"{st['prompt_tokens_per_s']:.1f} tok/s | generated: {st['generated_tokens']} tokens at "
            f"{st['gen_tokens_per_s']:.1f} tok/s | load {st['load_s']:.2f} s, setup {st['setup_s']:.2f} s | "
            f"peak RSS {st['peak_rss_mb']:.0f} MB")


def cmd_run(args) -> int:
    from .models.generate import Session

    model, load_s = _load(args)
    session = Session(model)
    ids = _prompt_ids(model, args, [{"role": "user", "content": args.prompt}])
    interrupted = False
    with CtrlCStops() as ctrl_c:
        streamer = Streamer(model.tokenizer, tuple(args.stop), None if args.json else sys.stdout, ctrl_c)
        try:
            session.generate(ids, callback=streamer, **_sampling(args))
        except (Interrupted, KeyboardInterrupt):  # keep what was generated
            interrupted = True
            session.stats["stop_reason"] = "interrupted"
    text = streamer.finish()
    st = _stats(session, load_s)
    if args.json:
        print(json.dumps({"text": text, "prompt_ids": ids, "generated_ids": streamer.ids, **st}))
    else:
        print()
        print(_stats_line(st), file=sys.stderr)
    return 130 if interrupted else 0


def cmd_convert(args) -> int:
    from .models.convert import convert

    if args.group_size is not None and args.bits is None:
        raise ValueError("--group-size needs --bits")
    done = convert(args.model, args.output, bits=args.bits, group_size=args.group_size, head_bits=args.head_bits,
                   shared_table=args.shared_table)
    if args.json:
        print(json.dumps(done))
        return 0
    mib = {k: v / 2**20 for k, v in done["bytes"].items()}
    rows = [("source", getattr(args, "model_name", args.model)), ("output", args.output),
            ("quantized layers", f"{done['quantized_layers']} ({', '.join(done['formats']) or 'none'})"),
            ("file size", f"{done['file_bytes'] / 2**20:.1f} MiB (source {done['source_bytes'] / 2**20:.1f} MiB): "
                          + ", ".join(f"{k} {v:.1f}" + (" (the head's, shared)" if k == "token table" and
                                                       done["table_from_head"] else "") for k, v in mib.items())),
            ("time", f"{done['seconds']:.1f} s")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def cmd_chat(args) -> int:
    from .models.generate import Session

    if sys.stdin is None or sys.stdin.closed:
        raise ValueError("tmac chat reads its messages from standard input, which is closed; for one prompt use "
                         "tmac run -p TEXT")
    model, load_s = _load(args)
    session = Session(model)
    print(f"tmac chat: {model.source} loaded in {load_s:.1f} s. /reset starts over, /exit quits, Ctrl-C stops an "
          f"answer.", file=sys.stderr)
    messages: list[dict] = []
    while True:
        line = _read_line("> ")
        if line is None:
            return 0
        if line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = []
            print("(conversation reset)", file=sys.stderr)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            answered = _chat_turn(model, session, args, messages)
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
    """A line from standard input, None at its end (Ctrl-D) or on Ctrl-C while waiting."""
    try:
        return input(prompt)
    except (EOFError, KeyboardInterrupt, RuntimeError):  # (RuntimeError: standard input was closed meanwhile)
        print()
        return None


def _chat_turn(model, session, args, messages: list[dict]) -> bool:
    """Answer the last user message, streaming; Ctrl-C during the answer stops it and keeps what was said."""
    ids, dropped = fit_context(model, args, messages)
    if dropped:
        print(f"(context full: dropped the {dropped} oldest exchange{'s' if dropped > 1 else ''})", file=sys.stderr)
    with CtrlCStops() as ctrl_c:
        streamer = Streamer(model.tokenizer, tuple(args.stop), sys.stdout, ctrl_c)
        try:
            session.generate(ids, callback=streamer, **_sampling(args))
        except (Interrupted, KeyboardInterrupt):
            session.stats["stop_reason"] = "interrupted"
    messages.append({"role": "assistant", "content": streamer.finish()})
    return True


def cmd_serve(args) -> int:
    try:
        import uvicorn

        from .serve import create_app, model_name
    except ImportError as e:
        raise ValueError(f"tmac serve needs FastAPI and uvicorn ({e}); pip install fastapi uvicorn") from None
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    model, _ = _load(args)
    name = model_name(model.source)
    app = create_app(model, name, args.api_key, args.max_batch, args.max_queue)
    print(f"tmac: serving {name} at http://{args.host}:{args.port}/v1 (OpenAI API; context {model.context} tokens, "
          f"up to {args.max_batch} requests at once{', API key required' if args.api_key else ''}); Ctrl-C stops",
          file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
