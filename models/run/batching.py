"""Continuous batching: many generations over one model, stepped together on a thread of their own: the scheduler
over the per-sequence core (``generation.Generation``) that a ``Session`` runs for one sequence.

Each running request holds a ``Sequence`` (a KV cache of the model's context, kept for the next request when it
ends: at most ``max_batch`` of them, made as they are first needed). A new request takes the kept cache that already
holds the longest start of its prompt (a conversation's next turn resends the whole conversation: only the new part
is fed), is prefilled between steps, at most ``PREFILL_BUDGET`` prompt tokens between two (a long prompt does not
stall the running streams for its whole prefill), and joins the batch; every step then feeds the last token of each
active sequence through the model's ``DecodePlan`` for that many rows: the glue row by row, each projection once for
all of them (the LUT GEMM reads each weight once for all the rows), so that each gets exactly the logits it gets
alone (``tmac run``'s). A model without such a plan steps the sequences one after another through its one-row plan,
or all at once through ``Transformer.forward_rows``. A request that finishes, is cancelled or whose consumer went
away leaves at the next boundary and frees its cache. Results go back through a callback per request (the server
hands them to its event loop).
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


from tmac.models.run.decode import Plans, multiplies
from tmac.models.run.generate import check_prompt
from tmac.models.run.generation import PREFILL_CHUNK, Generation, reusable_prefix, step_together
from tmac.models.run.sampling import SamplingParams
from tmac.models.run.sequence import Sequence

# prompt tokens prefilled between two decode steps: several short prompts at once, a long one in pieces, each
# piece a pause of the running streams (docs/decisions.md, "A served prompt is prefilled between decode steps")
PREFILL_BUDGET = 64


class Busy(Exception):
    """The queue is full: try again later."""


class _Cancelled(Exception):
    pass


@dataclass
class Request:
    """One generation. ``emit(piece, finish_reason, logprobs)`` is called from the batching thread with each new
    text piece and the ``TokenLogprob`` of the tokens it completes (with ``params.logprobs``; else empty).
    ``finish_reason`` is None until the last call: ``"stop"`` or ``"length"``; ``"abort"`` when the server stops;
    ``"busy"`` (no memory for its KV cache now) or ``"error"`` with the message as the piece."""

    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[str, str | None, list], object]
    ids: list[int] = field(default_factory=list)  # generated so far
    cached: int = 0  # the prompt's first tokens found in a kept cache (not fed again)
    cancelled: bool = False  # set by the consumer: the request leaves at the next step

    def cancel(self) -> None:
        self.cancelled = True


class _Active:
    """A request and its generation; ``sent``: its token logprobs already handed out."""

    def __init__(self, request: Request, generation: Generation):
        self.request, self.generation = request, generation
        self.sent = 0
        self.tail = ""  # the text its last token completed, handed out with the finish

    @property
    def sequence(self) -> Sequence:
        return self.generation.sequence

    def emit(self, piece: str, finish: str | None) -> None:
        g = self.generation
        logprobs, self.sent = g.logprobs[self.sent:], len(g.logprobs)
        self.request.emit(piece, finish, logprobs)


class Batcher:
    """Runs the requests it is given (``submit``) on one thread, ``max_batch`` sequences at a time, with at most
    ``max_queue`` more waiting (``submit`` raises ``Busy`` past that). ``close()`` stops the thread."""

    def __init__(self, model, max_batch: int = 4, max_queue: int = 16):
        if type(max_batch) is not int or max_batch < 1 or type(max_queue) is not int or max_queue < 0:
            raise ValueError(f"max_batch must be an int >= 1 and max_queue an int >= 0, got {max_batch!r}, "
                             f"{max_queue!r}")
        if model.tokenizer is None:
            raise ValueError("serving text needs the model's tokenizer, and this model was loaded without one")
        self.model, self.max_batch, self.max_queue = model, max_batch, max_queue
        self.max_caches = kv_caches_that_fit(model, max_batch)  # (the batch's caches budgeted together)
        self.waiting: collections.deque[tuple[Request, Generation]] = collections.deque()
        self.active: list[_Active] = []
        self.admitting: collections.deque[_Active] = collections.deque()  # prompts being prefilled, in turn
        self.steps = 0
        self.widest = 0  # the most sequences one step has served
        self.stepped = 0  # tokens the steps have fed (one a sequence a step; prefills apart)
        self.prefilled = self.reused = 0  # prompt tokens fed by prefills, and found in kept caches instead
        self.step_seconds = 0.0  # spent in the steps
        self._wake = threading.Condition()
        self._closed = False
        self._plans = Plans(model).current()  # (the model stays as it is while served)
        self._free: list[Sequence] = []  # the caches of finished requests, for the next ones (the oldest first)
        # a prompt's rows that take dot products are not what decode steps compute: a kept cache then offers its
        # prompt alone, so that a conversation's next turn gets a fresh server's answer (``multiplies``)
        self._prompts_only = multiplies(model)
        self._made = 0  # sequences made (at most max_batch)
        self._thread = threading.Thread(target=self._loop, name="tmac-batcher", daemon=True)
        self._thread.start()

    # ---- the consumer's side ---------------------------------------------------------------------------------
    def check(self, r: Request) -> Generation:
        """``ValueError`` naming what request ``r`` may not ask for; else its generation, without a cache yet."""
        prompt = check_prompt(r.prompt_ids, self.model.config.vocab_size)
        if r.params.max_tokens is not None and r.params.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int of at least 1, got {r.params.max_tokens!r:.40}")
        return Generation(self.model, prompt, r.params, _NO_CACHE, self.model.tokenizer)

    def submit(self, request: Request) -> None:
        generation = self.check(request)
        with self._wake:
            if self._closed:
                raise RuntimeError("the server is shutting down")
            if len(self.waiting) >= self.max_queue + max(0, self.max_caches - len(self.active) - len(self.admitting)):
                raise Busy(f"{len(self.active) + len(self.admitting)} requests running and {len(self.waiting)} "
                           f"waiting")
            self.waiting.append((request, generation))
            self._wake.notify()

    def shutdown(self) -> None:
        """Stop taking requests and end those running or waiting at the next boundary (a decode step, a prefill
        chunk) with finish reason ``"abort"`` and what they said so far; returns at once (any thread)."""
        with self._wake:
            self._closed = True
            self._wake.notify()

    def close(self) -> None:
        """``shutdown``, then wait for the batching thread to end."""
        self.shutdown()
        self._thread.join()

    def load(self) -> dict:
        return {"running": len(self.active), "prefilling": len(self.admitting), "waiting": len(self.waiting),
                "max_batch": self.max_batch, "kv_caches": self.max_caches, "max_queue": self.max_queue,
                "steps": self.steps, "widest": self.widest, "stepped": self.stepped,
                "step_seconds": round(self.step_seconds, 6), "prefilled": self.prefilled, "reused": self.reused}

    # ---- the batching thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self.waiting and not self.active and not self.admitting:
                    self._wake.wait()
                if self._closed:
                    for a in [*self.active, *self.admitting]:
                        if not a.request.cancelled:
                            a.emit(a.tail + a.generation.close(), "abort")
                    for r, _ in self.waiting:
                        r.emit("", "abort", [])
                    return
                joining = []
                while self.waiting and len(self.active) + len(self.admitting) + len(joining) < self.max_caches:
                    joining.append(self.waiting.popleft())
            for request, generation in joining:
                self._admit(request, generation)
            self._prefill_some()
            self._step()

    def _admit(self, request: Request, generation: Generation) -> None:
        """Give ``request`` a cache (``_cache_for``) and queue its prompt for prefilling."""
        if request.cancelled:
            return
        try:
            sequence, reuse = self._cache_for(generation.prompt)
        except (ValueError, MemoryError, RuntimeError) as e:  # no memory for its cache now: try again later
            request.emit(f"no memory for another KV cache now ({e})", "busy", [])
            return
        generation.sequence, generation.cached = sequence, reuse
        request.cached, self.reused = reuse, self.reused + reuse
        self.admitting.append(_Active(request, generation))

    def _prefill_some(self) -> None:
        """Up to ``PREFILL_BUDGET`` prompt tokens of the admitting requests, in turn, or while none runs the whole
        prompt (no stream to pause; a piece at a time costs a little more); one whose prompt is all in its cache
        samples its first token and joins the batch."""
        budget = PREFILL_BUDGET
        while self.admitting and (budget > 0 or not self.active) and not self._closed:
            a = self.admitting[0]
            g = a.generation
            fed = len(g.sequence.ids)  # (the cache holds the prompt's first tokens)
            try:
                if a.request.cancelled:
                    raise _Cancelled
                with torch.inference_mode():  # (alone, a chunk at a time: a
                    piece = g.feed(self._plans, budget if self.active else PREFILL_CHUNK)  # shutdown is seen)
                done = len(g.sequence.ids) - fed
                self.prefilled, budget = self.prefilled + done, budget - done
                if not g.prompt_fed:
                    continue
                self.admitting.popleft()
            except Exception as e:  # a request's failure is its own: the others go on
                if self.admitting and self.admitting[0] is a:
                    self.admitting.popleft()
                if not isinstance(e, _Cancelled):
                    g.sequence.ids = []  # (what its cache holds is not known)
                    a.emit(f"{type(e).__name__}: {e}", "error")
                self._free.append(g.sequence)
                continue
            self.active.append(a)
            self._hand_out(a, piece)
            if self._finished(a):
                self._leave([a])

    def _cache_for(self, prompt: list[int]) -> tuple[Sequence, int]:
        """A cache for ``prompt`` and how many of its first tokens it holds already: the kept cache sharing the
        longest start with it (all but its last token at most: that one's logits are needed); sharing none, a new
        cache while fewer than ``max_batch`` exist, else the one kept longest."""
        best, reuse = None, 0
        for i, kept in enumerate(self._free):
            n = reusable_prefix(kept.ids, prompt)
            if n > reuse:
                best, reuse = i, n
        if best is None and (self._made >= self.max_caches and self._free):
            best = 0
        if best is None:
            self._made += 1
            return Sequence(self.model, adopt=False), 0
        sequence = self._free.pop(best)
        del sequence.ids[reuse:]  # (the positions past them are written again)
        return sequence, reuse

    def _hand_out(self, a: _Active, piece: str) -> None:
        """The text a new token completed, to the request, unless that token ended it (then it goes with the
        finish)."""
        a.request.ids = a.generation.ids
        if a.generation.finish is None:
            if piece or a.sent < len(a.generation.logprobs):
                a.emit(piece, None)
        else:
            a.tail = piece

    def _finished(self, a: _Active) -> bool:
        """Whether ``a`` is done (its last piece and reason handed out)."""
        if a.request.cancelled:
            return True
        g = a.generation
        if g.finish is None:
            return False
        a.emit(a.tail + g.close(), "stop" if g.finish == "eos" else g.finish)
        return True

    def _step(self) -> None:
        self._leave([a for a in self.active if a.request.cancelled])
        if not self.active:
            return
        batch = self.active
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                pieces = step_together(self.model, self._plans, [a.generation for a in batch])
        except Exception as e:
            for a in batch:
                a.emit(f"{type(e).__name__}: {e}", "error")
                a.sequence.ids = []  # (what its cache holds is not known)
            self._leave(batch)
            return
        for a, piece in zip(batch, pieces):
            self._hand_out(a, piece)
        self.steps += 1
        self.stepped += len(batch)
        self.step_seconds += time.perf_counter() - start
        self.widest = max(self.widest, len(batch))
        self._leave([a for a in batch if self._finished(a)])

    def _leave(self, done: list[_Active]) -> None:
        """``done`` out of the batch, their caches kept for the next requests with what they hold (``ids``; where
        prompts multiply, their prompts)."""
        if done:
            self.active = [a for a in self.active if a not in done]
            if self._prompts_only:
                for a in done:
                    del a.sequence.ids[len(a.generation.prompt):]
            self._free += [a.sequence for a in done]


class _NoCache:
    """The cache of a generation not yet admitted: it holds nothing."""

    ids: list[int] = []


_NO_CACHE = _NoCache()


def kv_caches_that_fit(model, max_batch: int) -> int:
    """How many of ``max_batch`` KV caches of the model's context fit ``KV_MEMORY_SHARE`` of the memory available
    now (the machine's, or its container's); ``ValueError`` where not even one does."""
    from tmac.base.memory import available_bytes

    from tmac.models.family.llama import KV_MEMORY_SHARE

    free = available_bytes()
    if free is None:
        return max_batch
    one = model.kv_bytes(model.context, model.kv_dtype)
    fit = int(free * KV_MEMORY_SHARE // one)
    if fit < 1:
        raise ValueError(f"one request's KV cache ({model.context} positions, {model.kv_dtype}) needs "
                         f"{one / 2**30:.2f} GiB, more than {KV_MEMORY_SHARE:.0%} of the {free / 2**30:.2f} GiB "
                         f"available: give a smaller --context")
    return min(max_batch, fit)
