"""The per-sequence generation core: one prompt, its KV cache (a ``Sequence``), its sampler and its text, fed and
stepped by whoever runs it — ``Session`` for one sequence, the server's ``Batcher`` for many at once. Both run
exactly this code between the model's logits and the tokens and text handed out, so a batched answer is the one a
session gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tmac.models.run.sampling import Sampler, SamplingParams, check_for_vocabulary, logprobs
from tmac.models.run.sequence import Sequence
from tmac.models.text.stream import TextStream

if TYPE_CHECKING:
    from tmac.models.run.decode import Plans

# a long prompt is prefilled this many tokens at a time: each chunk's activations stay in the caches
# (docs/decisions.md, "Prompts are prefilled")
PREFILL_CHUNK = 256


def prefill(model, ids: list[int], sequence: Sequence, first: int = 0, last_only: bool = False,
            plans: Plans | None = None, spent: dict | None = None):
    """Feed ``ids[first:]`` into ``sequence`` (which holds ``ids[:first]``), ``PREFILL_CHUNK`` tokens at a time:
    yields each chunk's end and its logits (the last row's alone with ``last_only``). With ``plans`` (current) and
    ``last_only``, a chunk runs through its prefill plan where the model has one: every projection once for the
    chunk, everything else compiled glue, and the logits those of a token-by-token decode where a prompt's rows look
    up tables (``multiplies``: with dot products, as close to the exact model; ``spent``: seconds by kind of call
    added to it, ``DecodePlan.kind``). Without a plan the eager model's projections multiply alike
    (``prompt_rows``)."""
    for start, end in prefill_chunks(first, len(ids)):
        plan = plans.prefill(end - start) if plans is not None and last_only else None
        if plan is None:
            import torch

            from tmac.execution.lut_ops import prompt_rows

            with prompt_rows():  # (its projections multiply as a plan's would)
                logits = model(torch.tensor(ids[start:end]), start, last_only=last_only, cache=sequence)
            yield end, logits
        else:
            yield end, plan.prefill(ids[start:end], start, sequence, spent)[None]


def prefill_chunks(first: int, end: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` of each chunk a prefill of positions ``first .. end-1`` runs."""
    return [(start, min(start + PREFILL_CHUNK, end)) for start in range(first, end, PREFILL_CHUNK)]


def reusable_prefix(cached: list[int], prompt: list[int]) -> int:
    """How many first tokens of ``prompt`` a cache holding ``cached`` serves: those they share, all but the prompt's
    last at most (it is always fed: its logits start decoding)."""
    n = 0
    for x, y in zip(cached, prompt[:-1]):
        if x != y:
            break
        n += 1
    return n


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the model, and the likeliest alternatives' (``SamplingParams.
    logprobs`` of them)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


class Generation:
    """One prompt's generation over ``sequence`` (whose ``ids`` are the tokens its cache holds: a start of the
    prompt, reused). ``feed`` prefills the prompt, ``take`` samples from a step's logits; the new tokens are
    ``ids``, their text comes out of ``take`` piece by piece, and ``finish`` says why it ended (``"eos"``, ``"stop"``,
    ``"length"``) once it has. ``next_id`` is the token sampled and not yet fed."""

    def __init__(self, model, prompt: list[int], params: SamplingParams, sequence: Sequence, tokenizer=None):
        check_for_vocabulary(params, model.config.vocab_size)
        room = model.context - len(prompt)
        self.max_tokens = max(room, 1) if params.max_tokens is None else params.max_tokens
        if self.max_tokens > room:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({self.max_tokens}) exceed the context of "
                             f"{model.context} tokens; shorten the prompt, lower max_tokens or load with a larger "
                             f"context (model maximum: {model.config.context_length})")
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model was loaded without one")
        self.model, self.prompt, self.params, self.sequence = model, prompt, params, sequence
        self.sampler = Sampler(params, prompt)
        self.text = TextStream(tokenizer, params.stop) if tokenizer is not None else None
        self.stop_ids = frozenset() if params.ignore_eos or tokenizer is None else tokenizer.stop_ids
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.next_id: int | None = None
        self.finish: str | None = "length" if self.max_tokens == 0 else None
        self.cached = 0  # prompt tokens found in a kept cache, not fed again (set by whoever runs it)

    @property
    def prompt_fed(self) -> bool:
        return len(self.sequence.ids) >= len(self.prompt)

    def feed(self, plans: Plans | None, budget: int | None = None) -> str:
        """Prefill up to ``budget`` more prompt tokens (None: the rest) through ``plans`` (None: eagerly); once the
        whole prompt is in, sample the first token. The text it completes."""
        prompt, fed = self.prompt, len(self.sequence.ids)
        end = len(prompt) if budget is None else min(len(prompt), fed + budget)
        logits = None
        for done, chunk_logits in prefill(self.model, prompt[:end], self.sequence, fed, last_only=True, plans=plans):
            logits = chunk_logits[-1]
            self.sequence.ids = prompt[:done]  # (an interrupted prefill keeps what it cached)
        return self.take(logits) if end == len(prompt) and self.finish is None else ""

    def step(self, plans: Plans | None) -> str:
        """Feed ``next_id`` through the one-row plan (or eagerly) and sample from the logits: the text it
        completes."""
        plan = plans.decode(1) if plans is not None else None
        token, pos = self.next_id, len(self.sequence.ids)
        if plan:
            logits = plan.step(token, pos, self.sequence)
        else:
            import torch

            logits = self.model(torch.tensor([token]), pos, last_only=True, cache=self.sequence)[-1]
        self.sequence.ids.append(token)
        return self.take(logits)

    def take(self, logits) -> str:
        """Sample the next token from ``logits``; the text it completes (held back while a stop string may be
        forming; the rest comes with ``close``)."""
        token = self.sampler.sample(logits)
        if self.params.logprobs is not None:
            self.logprobs.append(TokenLogprob(token, *logprobs(logits, token, self.params.logprobs)))
        self.ids.append(token)
        self.next_id = token
        if token in self.stop_ids:
            self.finish = "eos"
            return ""
        piece = self.text.push(token) if self.text is not None else ""
        if self.text is not None and self.text.stopped:
            self.finish = "stop"
        elif len(self.ids) >= self.max_tokens:
            self.finish = "length"
        return piece

    def close(self) -> str:
        """The text held back at the end (a tail that turned out not to start a stop string)."""
        return self.text.finish() if self.text is not None else ""


def step_together(model, plans: Plans, generations: list[Generation]) -> list[str]:
    """One decode step of every generation in ``generations``: their ``next_id`` fed through the model's plan for
    that many rows (every projection once for all), else one after another through the one-row plan, else all at
    once eagerly; each then samples. The text each completes."""
    tokens = [g.next_id for g in generations]
    positions = [len(g.sequence.ids) for g in generations]
    sequences = [g.sequence for g in generations]
    if (plan := plans.decode(len(generations))) is not None:
        rows = plan.step_rows(tokens, positions, sequences)
    elif (plan := plans.decode(1)) is not None:
        rows = [plan.step(t, p, q).clone() for t, p, q in zip(tokens, positions, sequences)]
    else:
        import torch

        rows = model.forward_rows(torch.tensor(tokens), positions, sequences)
    pieces = []
    for g, logits in zip(generations, rows):
        g.sequence.ids.append(g.next_id)
        pieces.append(g.take(logits))
    return pieces
