"""Continuous batching: many generations over one model, stepped together on a thread of their own.

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

from tmac import runtime

from .decode import Plans
from .generate import _check_sampling, check_prompt, check_seed, next_token, prefill, reusable_prefix
from .sequence import Sequence
from .text import TextStream, check_stop

# prompt tokens prefilled between two decode steps: several short prompts at once, a long one in pieces, each
# piece a pause of the running streams (docs/decisions.md, "A served prompt is prefilled between decode steps")
PREFILL_BUDGET = 64


class Busy(Exception):
    """The queue is full: try again later."""


class _Cancelled(Exception):
    pass


@dataclass
class Request:
    """One generation. ``emit(piece, finish_reason)`` is called from the batching thread with each new text piece
    (``finish_reason`` None until the last call: ``"stop"`` or ``"length"``, or ``"error"`` with the message as
    the piece)."""

    prompt_ids: list[int]
    max_tokens: int
    emit: Callable[[str, str | None], object]
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0  # on the last repeat_last_n tokens (prompt and answer), as llama.cpp's
    repeat_last_n: int = 64
    presence_penalty: float = 0.0  # OpenAI's, on the answer's tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ids: list[int] = field(default_factory=list)  # generated so far
    cached: int = 0  # the prompt's first tokens found in a kept cache (not fed again)
    cancelled: bool = False  # set by the consumer: the request leaves at the next step

    def cancel(self) -> None:
        self.cancelled = True


class _Active:
    def __init__(self, request: Request, sequence: Sequence, text: TextStream):
        self.request, self.sequence, self.text = request, sequence, text
        r = request
        self.sampling = dict(  # ``next_token``'s options, once for the request
            temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, repetition_penalty=r.repetition_penalty,
            repeat_last_n=r.repeat_last_n, presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty,
            generator=torch.Generator().manual_seed(r.seed) if r.seed is not None else None)
        self.history = list(request.prompt_ids)
        self.next_id: int | None = None  # sampled, not yet fed
        self.finish: str | None = None  # why it ended, once it has
        self.tail = ""  # the text its last token completed, handed out with the finish


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
        self.waiting: collections.deque[Request] = collections.deque()
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
        self._made = 0  # sequences made (at most max_batch)
        self._thread = threading.Thread(target=self._loop, name="tmac-batcher", daemon=True)
        self._thread.start()

    # ---- the consumer's side ---------------------------------------------------------------------------------
    def check(self, r: Request) -> tuple[str, ...]:
        """``ValueError`` naming what request ``r`` may not ask for; its stop strings, checked."""
        check_prompt(r.prompt_ids, self.model.config.vocab_size)
        if type(r.max_tokens) is not int or r.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int of at least 1, got {r.max_tokens!r:.40}")
        _check_sampling(r.max_tokens, r.temperature, r.top_k, r.top_p, r.repetition_penalty, r.repeat_last_n,
                        r.presence_penalty, r.frequency_penalty)
        if len(r.prompt_ids) + r.max_tokens > self.model.context:
            raise ValueError(f"the prompt ({len(r.prompt_ids)} tokens) and max_tokens ({r.max_tokens}) exceed the "
                             f"context of {self.model.context} tokens")
        check_seed(r.seed)
        return check_stop(r.stop)

    def submit(self, request: Request) -> None:
        request.stop = self.check(request)
        with self._wake:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            if len(self.waiting) >= self.max_queue + max(0, self.max_batch - len(self.active) - len(self.admitting)):
                raise Busy(f"{len(self.active) + len(self.admitting)} requests running and {len(self.waiting)} "
                           f"waiting")
            self.waiting.append(request)
            self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    def load(self) -> dict:
        return {"running": len(self.active), "prefilling": len(self.admitting), "waiting": len(self.waiting),
                "max_batch": self.max_batch, "max_queue": self.max_queue, "steps": self.steps, "widest": self.widest,
                "stepped": self.stepped,
                "step_seconds": round(self.step_seconds, 6), "prefilled": self.prefilled, "reused": self.reused}

    # ---- the batching thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self.waiting and not self.active and not self.admitting:
                    self._wake.wait()
                if self._closed:
                    for a in [*self.active, *self.admitting]:
                        a.request.emit("the server is shutting down", "error")
                    for r in self.waiting:
                        r.emit("the server is shutting down", "error")
                    return
                joining = []
                while self.waiting and len(self.active) + len(self.admitting) + len(joining) < self.max_batch:
                    joining.append(self.waiting.popleft())
            for request in joining:
                self._admit(request)
            self._prefill_some()
            self._step()

    def _admit(self, request: Request) -> None:
        """Give ``request`` a cache (``_cache_for``) and queue its prompt for prefilling."""
        if request.cancelled:
            return
        try:
            sequence, reuse = self._cache_for(request.prompt_ids)
        except Exception as e:  # a request's failure is its own: the others go on
            request.emit(f"{type(e).__name__}: {e}", "error")
            return
        request.cached, self.reused = reuse, self.reused + reuse
        self.admitting.append(_Active(request, sequence, TextStream(self.model.tokenizer, request.stop)))

    def _prefill_some(self) -> None:
        """Up to ``PREFILL_BUDGET`` prompt tokens of the admitting requests, in turn, or while none runs the whole
        prompt (no stream to pause; a piece at a time costs a little more); one whose prompt is all in its cache
        samples its first token and joins the batch."""
        budget = PREFILL_BUDGET
        while self.admitting and (budget > 0 or not self.active):
            a = self.admitting[0]
            prompt, fed = a.request.prompt_ids, len(a.sequence.ids)  # (the cache holds the prompt's first tokens)
            end = min(len(prompt), fed + budget) if self.active else len(prompt)
            try:
                if a.request.cancelled:
                    raise _Cancelled
                with torch.inference_mode(), runtime.torch_single_threaded():
                    for _, chunk_logits in prefill(self.model, prompt[:end], a.sequence, fed, last_only=True,
                                                   plans=self._plans):
                        logits = chunk_logits[-1]
                    self.prefilled, budget = self.prefilled + end - fed, budget - (end - fed)
                    a.sequence.ids = prompt[:end]
                    if end < len(prompt):
                        continue
                    self.admitting.popleft()
                    self._take(a, logits)
            except Exception as e:  # a request's failure is its own: the others go on
                if self.admitting and self.admitting[0] is a:
                    self.admitting.popleft()
                if not isinstance(e, _Cancelled):
                    a.sequence.ids = []  # (what its cache holds is not known)
                    a.request.emit(f"{type(e).__name__}: {e}", "error")
                self._free.append(a.sequence)
                continue
            self.active.append(a)
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
        if best is None and (self._made >= self.max_batch and self._free):
            best = 0
        if best is None:
            self._made += 1
            return Sequence(self.model, adopt=False), 0
        sequence = self._free.pop(best)
        del sequence.ids[reuse:]  # (the positions past them are written again)
        return sequence, reuse

    def _take(self, a: _Active, logits: torch.Tensor) -> None:
        """Sample the next token of ``a`` from its logits and hand out the text it completes."""
        r = a.request
        token = next_token(logits, a.history, generated=r.ids, **a.sampling)
        r.ids.append(token)
        a.history.append(token)
        a.next_id = token
        if token in self.model.tokenizer.stop_ids:
            a.finish = "stop"
            return
        piece = a.text.push(token)
        a.finish = "stop" if a.text.stopped else "length" if len(r.ids) >= r.max_tokens else None
        if a.finish is None:
            if piece:
                r.emit(piece, None)
        else:
            a.tail = piece

    def _finished(self, a: _Active) -> bool:
        """Whether ``a`` is done (its last piece and reason handed out)."""
        if a.request.cancelled:
            return True
        if a.finish is None:
            return False
        a.request.emit(a.tail + a.text.finish(), a.finish)
        return True

    def _step(self) -> None:
        self._leave([a for a in self.active if a.request.cancelled])
        if not self.active:
            return
        batch = self.active
        start = time.perf_counter()
        try:
            with torch.inference_mode(), runtime.torch_single_threaded():
                tokens, positions = [a.next_id for a in batch], [len(a.sequence.ids) for a in batch]
                sequences = [a.sequence for a in batch]
                if (plan := self._plans.decode(len(batch))) is not None:  # every projection once for all
                    rows = plan.step_rows(tokens, positions, sequences)
                elif (plan := self._plans.decode(1)) is not None:  # one sequence after another
                    rows = [plan.step(t, p, q).clone() for t, p, q in zip(tokens, positions, sequences)]
                else:
                    rows = self.model.forward_rows(torch.tensor(tokens), positions, sequences)
                for a, logits in zip(batch, rows):
                    a.sequence.ids.append(a.next_id)
                    self._take(a, logits)
        except Exception as e:
            for a in batch:
                a.request.emit(f"{type(e).__name__}: {e}", "error")
                a.sequence.ids = []  # (what its cache holds is not known)
            self._leave(batch)
            return
        self.steps += 1
        self.stepped += len(batch)
        self.step_seconds += time.perf_counter() - start
        self.widest = max(self.widest, len(batch))
        self._leave([a for a in batch if self._finished(a)])

    def _leave(self, done: list[_Active]) -> None:
        """``done`` out of the batch, their caches kept for the next requests with what they hold (``ids``)."""
        if done:
            self.active = [a for a in self.active if a not in done]
            self._free += [a.sequence for a in done]
