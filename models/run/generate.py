"""Generation as a session over a model (``Session``): the per-sequence core (``generation.Generation``) run for one
sequence — a batched prefill (in chunks of ``PREFILL_CHUNK`` tokens), then one token at a time from the KV cache,
through the model's ``DecodePlan`` where it has one.

A session remembers which tokens the cache holds; a new prompt that extends them (the next turn of a chat) only
prefills what is new. Sampling: ``SamplingParams`` (``tmac.models.run.sampling``), the options the command line and the
server take too.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, Iterator

from tmac.models.run.generation import PREFILL_CHUNK, Generation, prefill, prefill_chunks, reusable_prefix  # noqa: F401
from tmac.models.run.sampling import SamplingParams
from tmac.models.run.sequence import Sequence
from tmac.models.text.stream import check_prompt_size


def _inference():
    """torch's inference mode where torch is in use (a run from a recipe never imports it)."""
    torch = sys.modules.get("torch")
    return torch.inference_mode() if torch is not None else contextlib.nullcontext()


def check_ids(ids, vocab: int, what: str = "prompt_ids") -> list[int]:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)) or not all(type(i) is int for i in ids):
        raise TypeError(f"{what} must be a list of ints")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"{what} holds ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    return list(ids)


class Session:
    """Generation over a model (``forward(ids, start, last_only)``, ``setup_cache``, ``context``): prefill, decode,
    sampling and their statistics, apart from the model as gpt-fast keeps ``generate.py`` apart from ``model.py``.

    A session remembers which tokens the model's KV cache holds for it, so a prompt that extends them (the next
    turn of a chat) only prefills what is new; another session using the same model, or a new cache, starts it
    over (so does ``reset``). ``static_decode``: decode through a ``DecodePlan`` (compiled glue, no torch ops)
    where the model allows; ``stats``: the last ``generate``'s statistics; ``last``: its ``Generation`` (the new
    ``ids``, with ``SamplingParams.logprobs`` their ``logprobs``)."""

    def __init__(self, model, tokenizer=None, static_decode: bool = True, sequence: Sequence | None = None,
                 plans=None):
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        self.static_decode = static_decode
        self.stats: dict = {}
        self.last: Generation | None = None
        self._sequence = sequence
        if plans is None:
            from tmac.models.run.decode import Plans

            plans = Plans(model)
        self._plans = plans  # (``tmac.models.run.recipe.RecordedPlans``: a model stepped without torch)

    @property
    def sequence(self) -> Sequence:
        """This session's ``Sequence``: its KV cache (the model's own for the first session of a model, else one of
        its own, made on first use) and the tokens it holds."""
        if self._sequence is None or not self._sequence.current(self.model):  # (the model's cache set up anew)
            self._sequence = Sequence(self.model)
        return self._sequence

    @property
    def cached_ids(self) -> list[int]:
        """The tokens whose keys and values this session's sequence holds."""
        return self.sequence.ids

    @cached_ids.setter
    def cached_ids(self, ids: list[int]) -> None:
        self.sequence.ids = ids

    def reset(self) -> None:
        """Forget what the cache holds: the next prompt is prefilled whole."""
        self.cached_ids = []

    def logits(self, ids: list[int]):
        """Float32 logits ``[len(ids), vocab]`` of a fresh sequence (for scoring and perplexity), run in chunks as
        a prefill is."""
        import torch

        vocab = self.model.config.vocab_size
        ids = check_ids(ids, vocab, "ids")
        if not ids:
            return torch.empty((0, vocab))
        if len(ids) > self.model.context:
            raise ValueError(f"{len(ids)} tokens exceed the context of {self.model.context} tokens")
        self.cached_ids = []
        with torch.inference_mode():
            out = torch.cat([logits for _, logits in self._prefill(ids, 0)])
        self.cached_ids = ids
        return out

    def _prefill(self, ids: list[int], first: int, last_only: bool = False):
        return prefill(self.model, ids, self.sequence, first, last_only, self._plans if self.static_decode else None)

    def generate(self, prompt, params: SamplingParams | None = None, *, stream: bool = False,
                 callback: Callable[[int], object] | None = None, text: bool | None = None, **options):
        """What follows ``prompt``: for a ``str`` the new text (no end-of-turn token, nothing from a ``stop`` string
        on); for a list of token ids the new ids (an end-of-generation token that ended it included).
        ``params``: a ``SamplingParams``, and ``options`` its fields by name (``max_tokens=64, temperature=0``;
        ``max_new_tokens`` and ``repetition_penalty`` are taken too). ``stream=True``: an iterator of the same,
        piece by piece as tokens come (text pieces, or ids). ``callback(id)`` is called as each token is produced.
        Generation stops at an end-of-generation token, at a ``stop`` string, after ``max_tokens`` or at the end of
        the context. Statistics land in ``self.stats``: seconds of set-up (the decode plan, and compiling kernels on
        a host's first use), prefill and decode, and the decode steps run (the first new token comes from the
        prefill's logits, so a generation of n tokens runs n − 1: decode speed is steps per second), and why it
        stopped. ``text``: text out for token ids in (default: text for text). ``last``: the last generation (its
        ``ids``, ``logprobs``, ``finish``)."""
        params = SamplingParams.make(params, **options)
        if isinstance(prompt, str):
            check_prompt_size(self._tokenizer(), len(prompt), self.model.context)
            return self._text(self._tokenizer().encode(prompt), params, callback, stream)
        if text:
            return self._text(prompt, params, callback, stream)
        tokens = self._tokens(prompt, params)
        if callback is not None:
            tokens = _calling(tokens, callback)
        return tokens if stream else list(tokens)

    def chat(self, messages: list[dict], params: SamplingParams | None = None, *, stream: bool = False,
             callback: Callable[[int], object] | None = None, **options):
        """The assistant's answer to ``messages`` (``[{"role": ..., "content": ...}, ...]``), rendered with the
        model's chat template: a ``str``, or with ``stream=True`` an iterator of text pieces. Sampling as
        ``generate``'s. Only what the conversation adds since this session's last call is prefilled."""
        params = SamplingParams.make(params, **options)
        tokenizer = self._tokenizer()
        check_prompt_size(tokenizer, sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict)),
                          self.model.context)
        return self._text(tokenizer.encode(tokenizer.render_chat(messages)), params, callback, stream)

    def _tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("text in and out needs a tokenizer, and this model was loaded without one; pass "
                             "token ids, or Session(model, tokenizer)")
        return self.tokenizer

    def _text(self, ids: list[int], params: SamplingParams, callback, stream: bool):
        prompt = check_ids(ids, self.model.config.vocab_size)
        generation = self._start(prompt, params)  # checks its arguments now, not at the first piece
        pieces = self._run(generation, callback, text=True)
        return pieces if stream else "".join(pieces)

    def _tokens(self, prompt_ids, params: SamplingParams) -> Iterator[int]:
        return self._run(self._start(prompt_ids, params), None, text=False)

    def _start(self, prompt_ids, params: SamplingParams) -> Generation:
        """The arguments checked, the generation made (its cache untouched until it runs)."""
        prompt = check_prompt(prompt_ids, self.model.config.vocab_size)
        return Generation(self.model, prompt, params, self.sequence, self.tokenizer)

    def _run(self, g: Generation, callback, text: bool) -> Iterator:
        """Prefill, then decode: yields each new token (or, with ``text``, each text piece)."""
        prompt, sequence = g.prompt, g.sequence
        reuse = reusable_prefix(sequence.ids, prompt)
        del sequence.ids[reuse:]
        g.cached = reuse
        stats = self.stats = {"prompt_tokens": len(prompt), "prefill_tokens": len(prompt) - reuse,
                              "setup_s": 0.0, "prefill_s": 0.0, "generated_tokens": 0, "decode_steps": 0,
                              "decode_s": 0.0, "stop_reason": "length"}
        self.last = g
        if g.finish is not None:  # max_tokens 0
            return
        with _inference():
            t0 = time.perf_counter()
            plans = self._plans.current() if self.static_decode else None
            if plans is not None:  # the plans (the prefill's chunks' sizes and the decode's) are set-up too
                if g.max_tokens > 1:
                    plans.decode(1)
                for size in {end - start for start, end in prefill_chunks(reuse, len(prompt))}:
                    plans.prefill(size)
            stats["setup_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            piece = g.feed(plans)
            stats["prefill_s"] = time.perf_counter() - t0
        # an interrupted or abandoned generation keeps its tokens and statistics; decode_s counts the steps, not
        # what the consumer of a stream does between them
        ids = sequence.ids
        while True:
            stats["generated_tokens"] = len(g.ids)
            if g.finish is not None:
                piece += g.close()
                stats["stop_reason"] = g.finish
            if callback is not None:
                callback(g.next_id)
            if text:
                if piece:
                    yield piece
            else:
                yield g.next_id
            if g.finish is not None:
                return
            if sequence.ids is not ids or self._sequence is not sequence:
                raise RuntimeError("another generation of this session used its sequence while this one was paused; "
                                   "finish or close one stream before starting the next (or use another Session)")
            t0 = time.perf_counter()
            with _inference():
                piece = g.step(plans)
            stats["decode_s"] += time.perf_counter() - t0
            stats["decode_steps"] += 1

    def decode_plan(self):
        """The model's ``DecodePlan`` (or ``None``: eager decoding), built on the first generation and kept while
        the model's modules, tensors and cache stay the ones it was built from. Building it loads every kernel the
        model runs, compiling what the cache lacks, before anything is timed."""
        return self._plans.current().decode(1)



def check_prompt(ids, vocab: int) -> list[int]:
    """The prompt's ids as a list, checked: in the vocabulary, and at least one."""
    prompt = check_ids(ids, vocab)
    if not prompt:
        raise ValueError("the prompt is empty: generation needs at least one token")
    return prompt


def _calling(tokens: Iterator[int], callback) -> Iterator[int]:
    for token in tokens:
        callback(token)
        yield token
