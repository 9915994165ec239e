"""Generation as a session over a model (``Session``): a batched prefill (in chunks of ``PREFILL_CHUNK`` tokens),
then one token at a time from the KV cache, through the model's ``DecodePlan`` where it has one.

A session remembers which tokens the cache holds; a new prompt that extends them (the next turn of a chat) only
prefills what is new. Sampling follows llama.cpp's order: repetition penalty over the last
``repeat_last_n`` tokens, then top-k, top-p and temperature; ``temperature=0`` is greedy.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Callable, Iterator

import numpy as np
import torch

from tmac import runtime
from tmac.linear import Linear

from .decode import DecodePlan, Plans
from .sequence import Sequence
from .text import TextStream, check_prompt_size, check_stop

# a long prompt is prefilled this many tokens at a time: each chunk's activations stay in the caches
# (docs/decisions.md, "Prompts are prefilled")
PREFILL_CHUNK = 256


def prefill(model, ids: list[int], sequence: Sequence, first: int = 0, last_only: bool = False,
            plans: Plans | None = None, spent: dict | None = None):
    """Feed ``ids[first:]`` into ``sequence`` (which holds ``ids[:first]``), ``PREFILL_CHUNK`` tokens at a time:
    yields each chunk's end and its logits (the last row's alone with ``last_only``). With ``plans`` (current) and
    ``last_only``, a chunk runs through its prefill plan where the model has one: every projection once for the
    chunk, everything else compiled glue, and the logits those of a token-by-token decode (``spent``: seconds by
    kind of call added to it, ``DecodePlan.kind``)."""
    for start, end in prefill_chunks(first, len(ids)):
        plan = plans.prefill(end - start) if plans is not None and last_only else None
        if plan is None:
            yield end, model(torch.tensor(ids[start:end]), start, last_only=last_only, cache=sequence)
        else:
            yield end, plan.prefill(ids[start:end], start, sequence, spent)[None]


def prefill_chunks(first: int, end: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` of each chunk a prefill of positions ``first .. end-1`` runs."""
    return [(start, min(start + PREFILL_CHUNK, end)) for start in range(first, end, PREFILL_CHUNK)]


def check_ids(ids, vocab: int, what: str = "prompt_ids") -> list[int]:
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)) or not all(type(i) is int for i in ids):
        raise TypeError(f"{what} must be a list of ints")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"{what} holds ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    return list(ids)


def next_token(logits: torch.Tensor, history: list[int], temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, repetition_penalty: float = 1.0, repeat_last_n: int = 64,
               generator: torch.Generator | None = None, presence_penalty: float = 0.0,
               frequency_penalty: float = 0.0, generated: list[int] = ()) -> int:
    """The next token from ``logits``: greedy at temperature 0, else sampled (top-k, then top-p). Penalties first:
    ``repetition_penalty`` on the last ``repeat_last_n`` tokens of ``history`` (llama.cpp's repeat penalty), and
    OpenAI's ``presence_penalty`` and ``frequency_penalty`` on the ``generated`` tokens (a token sampled c times so
    far loses c·frequency + presence)."""
    penalized = repetition_penalty != 1.0 and history and repeat_last_n
    counted = (presence_penalty or frequency_penalty) and len(generated)
    if temperature <= 0 and not penalized and not counted:  # greedy without a copy, numpy's argmax (faster)
        return int(np.argmax(logits.numpy())) if logits.dtype == torch.float32 else int(logits.argmax())
    logits = logits.float().clone()
    if penalized:
        idx = torch.tensor(sorted(set(history[-repeat_last_n:])))
        seen = logits[idx]
        logits[idx] = torch.where(seen > 0, seen / repetition_penalty, seen * repetition_penalty)
    if counted:
        ids, counts = np.unique(np.asarray(generated), return_counts=True)
        logits[torch.from_numpy(ids)] -= torch.from_numpy(counts).float() * frequency_penalty + presence_penalty
    if temperature <= 0:
        return int(logits.argmax())
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        logits[order[drop]] = float("-inf")
    # (the largest first: a tiny temperature then sends the others to -inf, not every logit to ±inf and NaN)
    probs = ((logits - logits.max()).double() / temperature).softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class Session:
    """Generation over a model (``forward(ids, start, last_only)``, ``setup_cache``, ``context``): prefill, decode,
    sampling and their statistics, apart from the model as gpt-fast keeps ``generate.py`` apart from ``model.py``.

    A session remembers which tokens the model's KV cache holds for it, so a prompt that extends them (the next
    turn of a chat) only prefills what is new; another session using the same model, or a new cache, starts it
    over. ``static_decode``: decode through a ``DecodePlan`` (compiled glue, no torch ops) where the model allows;
    ``stats``: the last ``generate``'s statistics."""

    def __init__(self, model, tokenizer=None, static_decode: bool = True, sequence: Sequence | None = None):
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        self.static_decode = static_decode
        self.stats: dict = {}
        self._sequence = sequence
        self._plans = Plans(model)

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

    def logits(self, ids: list[int]) -> torch.Tensor:
        """Float32 logits ``[len(ids), vocab]`` of a fresh sequence (for scoring and perplexity), run in chunks as
        a prefill is."""
        vocab = self.model.config.vocab_size
        ids = check_ids(ids, vocab, "ids")
        if not ids:
            return torch.empty((0, vocab))
        self._check_room(len(ids), 0)
        self.cached_ids = []
        with torch.inference_mode(), self._torch_threads(prefill=True):
            out = torch.cat([logits for _, logits in self._prefill(ids, 0)])
        self.cached_ids = ids
        return out

    def _prefill(self, ids: list[int], first: int, last_only: bool = False):
        return prefill(self.model, ids, self.sequence, first, last_only, self._plans if self.static_decode else None)

    def generate(self, prompt, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, repetition_penalty: float = 1.0, repeat_last_n: int = 64,
                 seed: int | None = None, stop: str | list[str] | tuple[str, ...] = (), stop_on_eos: bool = True,
                 callback: Callable[[int], object] | None = None, stream: bool = False):
        """What follows ``prompt``: for a ``str`` the new text (no end-of-turn token, nothing from a ``stop`` string
        on); for a list of token ids the new ids (an end-of-generation token that ended it included).
        ``stream=True``: an iterator of the same, piece by piece as tokens come (text pieces, or ids).
        ``callback(id)`` is called as each token is produced. Generation stops at an end-of-generation token, at a
        ``stop`` string or after ``max_new_tokens``. Statistics land in ``self.stats``: seconds of set-up (the
        decode plan, and compiling kernels on a host's first use), prefill and decode, and the decode steps run
        (the first new token comes from the prefill's logits, so a generation of n tokens runs n − 1: decode speed
        is steps per second), and why it stopped."""
        sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        repetition_penalty=repetition_penalty, repeat_last_n=repeat_last_n, seed=seed, stop=stop,
                        stop_on_eos=stop_on_eos)
        if isinstance(prompt, str):
            check_prompt_size(self._tokenizer(), len(prompt), self.model.context)
            return self._text(self._tokenizer().encode(prompt), sampling, callback, stream)
        tokens = self._tokens(prompt, **sampling)
        if callback is not None:
            tokens = _calling(tokens, callback)
        return tokens if stream else list(tokens)

    def chat(self, messages: list[dict], stream: bool = False, callback: Callable[[int], object] | None = None,
             **sampling):
        """The assistant's answer to ``messages`` (``[{"role": ..., "content": ...}, ...]``), rendered with the
        model's chat template: a ``str``, or with ``stream=True`` an iterator of text pieces. Sampling arguments as
        ``generate``'s. Only what the conversation adds since this session's last call is prefilled."""
        tokenizer = self._tokenizer()
        check_prompt_size(tokenizer, sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict)),
                          self.model.context)
        return self._text(tokenizer.encode(tokenizer.render_chat(messages)), sampling, callback, stream)

    def _tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("text in and out needs a tokenizer, and this model was loaded without one; pass "
                             "token ids, or Session(model, tokenizer)")
        return self.tokenizer

    def _text(self, ids: list[int], sampling: dict, callback, stream: bool):
        text = TextStream(self.tokenizer, sampling.get("stop", ()))
        tokens = self._tokens(ids, **sampling)  # checks its arguments now, not at the first piece
        if callback is not None:
            tokens = _calling(tokens, callback)
        pieces = _pieces(tokens, text)
        return pieces if stream else "".join(pieces)

    def _tokens(self, prompt_ids: list[int], max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, repetition_penalty: float = 1.0, repeat_last_n: int = 64,
                seed: int | None = None, stop=(), stop_on_eos: bool = True) -> Iterator[int]:
        """The arguments checked, then an iterator of the new ids."""
        prompt = check_prompt(prompt_ids, self.model.config.vocab_size)
        _check_sampling(max_new_tokens, temperature, top_k, top_p, repetition_penalty, repeat_last_n)
        stop = check_stop(stop)
        check_seed(seed)
        self._check_room(len(prompt), max_new_tokens)
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model was loaded without one")
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                        repeat_last_n=repeat_last_n,
                        generator=torch.Generator().manual_seed(seed) if seed is not None else None)
        stop_ids = self.tokenizer.stop_ids if stop_on_eos and self.tokenizer is not None else frozenset()
        return self._run(prompt, max_new_tokens, stop, stop_ids, sampling)

    def _run(self, prompt, max_new_tokens, stop, stop_ids, sampling) -> Iterator[int]:
        reuse = reusable_prefix(self.cached_ids, prompt)
        stats = self.stats = {"prompt_tokens": len(prompt), "prefill_tokens": len(prompt) - reuse,
                              "setup_s": 0.0, "prefill_s": 0.0, "generated_tokens": 0, "decode_steps": 0,
                              "decode_s": 0.0, "stop_reason": "length"}
        with torch.inference_mode(), self._torch_threads(prefill=True):
            t0 = time.perf_counter()
            plans = self._plans.current() if self.static_decode else None
            plan = plans.decode(1) if plans is not None and max_new_tokens > 1 else None
            if plans is not None:  # the prefill's plans (of its chunks' sizes) are set-up too
                for size in {end - start for start, end in prefill_chunks(reuse, len(prompt))}:
                    plans.prefill(size)
            stats["setup_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            self.cached_ids = prompt[:reuse]
            for end, chunk_logits in self._prefill(prompt, reuse, last_only=True):
                logits = chunk_logits[-1]
                self.cached_ids = prompt[:end]  # (an interrupted prefill keeps what it cached)
            stats["prefill_s"] = time.perf_counter() - t0
        # an interrupted or abandoned generation keeps its tokens and statistics; decode_s counts the steps, not
        # what the consumer of a stream does between them
        yield from self._decode(plan, list(prompt), logits, max_new_tokens, stats, stop, stop_ids, sampling)

    def decode_plan(self) -> DecodePlan | None:
        """The model's ``DecodePlan`` (or ``None``: eager decoding), built on the first generation and kept while
        the model's modules, tensors and cache stay the ones it was built from. Building it loads every kernel the
        model runs, compiling what the cache lacks, before anything is timed."""
        return self._plans.current().decode(1)

    def _torch_threads(self, prefill: bool = False):
        """torch on one thread while LUT layers run: the torch ops beside them are small or (a float head) slower
        sharing the cores with the kernels' pool than alone; a float model keeps torch's threads. So does an eager
        ``prefill`` (no plans) where torch's idle OpenMP workers sleep (``OMP_WAIT_POLICY=PASSIVE``, set by tmac
        when imported before torch): attention over a long prompt is its largest torch op (docs/decisions.md,
        "torch runs on one thread")."""
        passive = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
        if not any(isinstance(m, Linear) for m in self.model.modules()) or \
                prefill and passive and not self.static_decode:
            return contextlib.nullcontext()
        return runtime.torch_single_threaded()

    def _decode(self, plan, history, logits, max_new_tokens, stats, stop, stop_ids, sampling) -> Iterator[int]:
        sequence = self.sequence
        ids, out = sequence.ids, []
        while len(out) < max_new_tokens:
            t0 = time.perf_counter()
            with torch.inference_mode(), self._torch_threads():
                token = next_token(logits, history, **sampling)
            stats["decode_s"] += time.perf_counter() - t0
            out.append(token)
            history.append(token)
            stats["generated_tokens"] = len(out)
            yield token
            if token in stop_ids:
                stats["stop_reason"] = "eos"
                return
            if stop and any(s in self.tokenizer.decode(out) for s in stop):
                stats["stop_reason"] = "stop"
                return
            if len(out) == max_new_tokens:
                return
            if sequence.ids is not ids or self._sequence is not sequence:
                raise RuntimeError("another generation of this session used its sequence while this one was paused; "
                                   "finish or close one stream before starting the next (or use another Session)")
            pos = len(ids)
            t0 = time.perf_counter()
            with torch.inference_mode(), self._torch_threads():
                logits = plan.step(token, pos, sequence) if plan else \
                    self.model(torch.tensor([token]), pos, last_only=True, cache=sequence)[-1]
            stats["decode_s"] += time.perf_counter() - t0
            ids.append(token)
            stats["decode_steps"] += 1

    def _check_room(self, prompt: int, new: int) -> None:
        context = self.model.context
        if prompt + new > context:
            raise ValueError(f"prompt ({prompt} tokens) + max_new_tokens ({new}) exceed the context of "
                             f"{context} tokens; shorten the prompt, lower max_new_tokens or load with a "
                             f"larger context (model maximum: {self.model.config.context_length})")


def check_prompt(ids, vocab: int) -> list[int]:
    """The prompt's ids as a list, checked: in the vocabulary, and at least one."""
    prompt = check_ids(ids, vocab)
    if not prompt:
        raise ValueError("the prompt is empty: generation needs at least one token")
    return prompt


def check_seed(seed) -> None:
    if seed is not None and (type(seed) is not int or not 0 <= seed < 2 ** 63):
        raise ValueError(f"seed must be None or an int in [0, 2**63), got {seed!r:.40}")


def reusable_prefix(cached: list[int], prompt: list[int]) -> int:
    """How many first tokens of ``prompt`` a cache holding ``cached`` serves: those they share, all but the prompt's
    last at most (it is always fed: its logits start decoding)."""
    n = 0
    for x, y in zip(cached, prompt[:-1]):
        if x != y:
            break
        n += 1
    return n


def _check_sampling(max_new_tokens, temperature, top_k, top_p, repetition_penalty, repeat_last_n,
                    presence_penalty=0.0, frequency_penalty=0.0) -> None:
    def is_int(v):
        return type(v) is int

    def is_num(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v

    checks = [
        (is_int(max_new_tokens) and max_new_tokens >= 0, f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}"),
        (is_num(temperature) and temperature >= 0, f"temperature must be a number >= 0, got {temperature!r}"),
        (is_int(top_k) and top_k >= 0, f"top_k must be an int >= 0 (0: off), got {top_k!r}"),
        (is_num(top_p) and 0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p!r}"),
        (is_num(repetition_penalty) and repetition_penalty > 0,
         f"repetition_penalty must be > 0, got {repetition_penalty!r}"),
        (is_int(repeat_last_n) and repeat_last_n >= 0, f"repeat_last_n must be an int >= 0, got {repeat_last_n!r}"),
        *((is_num(v) and -2 <= v <= 2, f"{what} must be in [-2, 2], got {v!r}")  # OpenAI's range
          for what, v in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty))),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def _calling(tokens: Iterator[int], callback) -> Iterator[int]:
    for token in tokens:
        callback(token)
        yield token


def _pieces(tokens: Iterator[int], text: TextStream) -> Iterator[str]:
    for token in tokens:
        piece = text.push(token)
        if piece:
            yield piece
    tail = text.finish()
    if tail:
        yield tail
