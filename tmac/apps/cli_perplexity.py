"""``tmac perplexity``: how well a model, as loaded (its own quantization or requantized), predicts a text."""

from __future__ import annotations

import json
import os
import time

from tmac.apps.cli_generate import HEAD_BITS_HELP, _load, head_bits_arg
from tmac.base.formats import BITS, GROUP_SIZES


def add_parser(sub, common) -> None:
    p = sub.add_parser("perplexity", parents=[common],
                       help="perplexity over a text (windows as llama.cpp's llama-perplexity); lower is better")
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF file, Hugging Face directory or .tmac file (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--text", metavar="FILE", help="a UTF-8 text file (default: a public-domain sample tmac ships, "
                                                   "about 3,500 tokens)")
    p.add_argument("-c", "--context", type=int, default=512,
                   help="tokens per window; the second half of each is scored (default 512, as llama-perplexity)")
    p.add_argument("--windows", type=int, help="score at most this many windows (default: all the text holds)")
    p.add_argument("--bits", type=int, choices=BITS, help="requantize the projections to this many bits")
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, help="group size with --bits")
    p.add_argument("--head-bits", type=head_bits_arg, help=HEAD_BITS_HELP)
    p.add_argument("--threads", "-t", type=int, help="kernel and torch threads (default: physical cores)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=cmd_perplexity, kv_dtype="float16")


def cmd_perplexity(args) -> int:
    from tmac.models.run.perplexity import DEFAULT_TEXT, DEFAULT_TEXT_NAME, PIECE_CHARS, perplexity, tokenize

    from tmac.base import files
    from tmac.base.progress import Progress

    if args.windows is not None and args.windows < 1:
        raise ValueError(f"--windows must be >= 1, got {args.windows}")
    path = args.text or DEFAULT_TEXT
    try:
        text = files.read_regular(path, 64 << 20).decode()
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"--text {path}: cannot read it as UTF-8 text ({e})") from None
    t0 = time.perf_counter()
    model, _ = _load(args)  # (--context: the window, all the model needs to hold)
    need = None if args.windows is None else args.windows * args.context
    with Progress("tokenizing", -(-len(text) // PIECE_CHARS), None if len(text) > 4 * PIECE_CHARS else False) as bar:
        ids = tokenize(model.tokenizer, text, need, bar)
    with Progress("scoring", args.windows or max(1, len(ids) // args.context), True) as bar:
        result = perplexity(model, ids, args.context, args.windows, bar)
    seconds = time.perf_counter() - t0
    described = {"model": model.source, "bits": args.bits or "own", "text": args.text or DEFAULT_TEXT_NAME,
                 "text_tokens": result.text_tokens, "context": result.context, "windows": result.windows,
                 "tokens_scored": result.tokens_scored, "perplexity": result.perplexity,
                 "uncertainty": result.uncertainty, "window_perplexities": result.window_perplexities,
                 "seconds": seconds}
    if args.json:
        print(json.dumps(described))
        return 0
    rows = [("model", os.path.basename(str(model.source)) + ("" if args.bits is None else f" requantized to W{args.bits}")),
            ("text", f"{described['text']} ({result.text_tokens} tokens)"),
            ("windows", f"{result.windows} of {result.context} tokens, {result.tokens_scored} tokens scored"),
            ("perplexity", f"{result.perplexity:.4f} ± {result.uncertainty:.4f}"),
            ("time", f"{seconds:.1f} s")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0
