"""Perplexity of a model over a text, windowed as llama.cpp's ``llama-perplexity`` is, so the two compare.

The text is tokenized (with BOS when the model's metadata asks for it; a long one in pieces, and only as far as
the windows asked for need) and cut into windows of ``context``
tokens; a window's first token becomes BOS when the model adds one. Each window runs from a fresh cache and only
its second half is scored — every scored token sees at least ``context / 2`` tokens before it — so
``perplexity = exp(mean over scored tokens of −log p(token | the tokens before it in its window))``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import tmac

from tmac.models.run.generate import Session

PIECE_CHARS = 1 << 18  # a long text is tokenized this many characters at a time (a few MB of tokenizer memory)
OVERLAP = 4096  # characters past a piece's end it is tokenized with: more than any word's
DEFAULT_TEXT = os.path.join(os.path.dirname(tmac.__file__), "data", "perplexity.txt")
DEFAULT_TEXT_NAME = "US founding documents and two addresses of Lincoln (public domain, shipped with tmac)"


@dataclass
class Perplexity:
    perplexity: float
    uncertainty: float  # one standard error of the perplexity, from the spread of the tokens' log-likelihoods
    tokens_scored: int
    windows: int
    context: int
    text_tokens: int
    window_perplexities: list[float] = field(default_factory=list)


def perplexity(model, text, context: int = 512, max_windows: int | None = None, progress=None) -> Perplexity:
    """The perplexity of ``model`` (a loaded model with its tokenizer) over ``text`` (a string, or its token ids as
    ``tokenize`` gives them), windows of ``context`` tokens (at most ``max_windows``: only the text they need is
    tokenized); ``progress.advance()`` is called after each window."""
    import torch

    if model.tokenizer is None:
        raise ValueError("the model has no tokenizer, so it cannot read a text")
    if type(context) is not int or context < 16 or context % 2:
        raise ValueError(f"context must be an even number of tokens >= 16, got {context!r}")
    if context > model.context:
        raise ValueError(f"context {context} is more than the model was loaded with ({model.context}): load it with "
                         f"context={context}")
    tok = model.tokenizer
    ids = tokenize(tok, text, None if max_windows is None else max_windows * context) if isinstance(text, str) \
        else text
    windows = len(ids) // context if max_windows is None else min(len(ids) // context, max_windows)
    if windows < 1:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {context}: give a longer text "
                         f"or a smaller context")
    first = context // 2
    losses, per_window, session = [], [], Session(model)
    for w in range(windows):
        window = ids[w * context:(w + 1) * context].tolist()
        inputs = [tok.bos_id] + window[1:] if tok.add_bos and tok.bos_id is not None else window
        logits = session.logits(inputs)[first:context - 1].double()
        targets = torch.tensor(window[first + 1:context])
        nll = -torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
        losses.append(nll)
        per_window.append(math.exp(float(nll.mean())))
        if progress is not None:
            progress.advance(f"window {w + 1}: {per_window[-1]:.2f}")
    nll = torch.cat(losses)
    mean = float(nll.mean())
    ppl = math.exp(mean)
    spread = float(nll.var(correction=0)) if nll.numel() > 1 else 0.0
    uncertainty = ppl * math.sqrt(spread / max(1, nll.numel() - 1))
    return Perplexity(ppl, uncertainty, int(nll.numel()), windows, context, len(ids), per_window)


def tokenize(tok, text: str, need: int | None = None, progress=None):
    """The token ids of ``text`` (an ``array``: 4 bytes a token), the same as ``tok.encode(text)`` gives, tokenized
    ``PIECE_CHARS`` characters at a time and stopped once ``need`` tokens are there. Each piece is tokenized with
    ``OVERLAP`` characters of the next, and only its tokens that end before the cut are kept: the next piece starts
    where they end, so a word across the cut is tokenized whole."""
    from array import array

    ids = array("i", [tok.bos_id] if tok.add_bos and tok.bos_id is not None else [])
    pos = 0
    while pos < len(text) and (need is None or len(ids) < need):
        end = pos + PIECE_CHARS
        encoding = tok.backend.encode(text[pos:end + OVERLAP], add_special_tokens=False)
        if end + OVERLAP >= len(text):
            ids.extend(encoding.ids)
            break
        keep = sum(1 for _, stop in encoding.offsets if stop <= PIECE_CHARS)
        if keep == 0:  # (one token longer than a piece)
            keep = 1
        ids.extend(encoding.ids[:keep])
        pos += encoding.offsets[keep - 1][1]
        if progress is not None:
            progress.advance()
    return ids
