"""A step of a model as a flat list of calls into compiled code, and how a step, a batch of steps and a prefill run
it: what a ``DecodePlan`` (built from a model) and a ``RecordedPlan`` (read back from a recipe, without torch) share.
Nothing here imports torch: the buffers are whatever arrays the plan was made with.
"""

from __future__ import annotations

import time

from tmac.base.glue import ROWS, PARALLEL_ATTENTION_WORK
from tmac.execution import runtime
from tmac.quant.spec import PARALLEL_TABLE_ROWS


class CallPlan:
    """One token's step (``rows`` of them: sequences stepped together, or a prompt's consecutive positions) as
    ``calls``, ``(function, args)`` in order. Set by a subclass: ``calls``; ``rows_positions`` (per row, per layer:
    the attend call's argument list, whose ``slots`` — position, keys, values — a step sets); ``own_cache`` (per
    layer: the handles of the cache the plan was made with); ``embed_rows`` (per row: a function writing a token's
    row into the step's input); ``buf["logits"]``; ``context``, ``vocab``; ``labels`` (id of a function → its name)
    and ``glue_spec`` (for ``kind``)."""

    def step(self, token: int, pos: int, sequence=None):
        """Logits ``[vocab]`` of ``token`` at position ``pos`` of ``sequence`` (a ``Sequence``, whose cache holds
        positions ``< pos``; default: the plan's own cache). The returned array is the plan's buffer: the next
        step overwrites it."""
        self._place(0, token, pos, sequence)
        runtime.apply_threads()
        self.embed_rows[0](token)
        self._run()
        return self.buf["logits"][0]

    def step_rows(self, tokens: list[int], positions: list[int], sequences: list):
        """Logits ``[rows, vocab]`` of one step for each of the plan's ``rows`` sequences: ``tokens[r]`` at
        ``positions[r]`` of ``sequences[r]`` (``Sequence``s). Each row's logits are those ``step`` gives it alone.
        The returned array is the plan's buffer."""
        if not len(tokens) == len(positions) == len(sequences) == self.rows:
            raise ValueError(f"this plan steps {self.rows} sequences; got {len(tokens)} tokens, {len(positions)} "
                             f"positions and {len(sequences)} sequences")
        for r, (token, pos, sequence) in enumerate(zip(tokens, positions, sequences)):
            self._place(r, token, pos, sequence)
        runtime.apply_threads()
        for r, token in enumerate(tokens):
            self.embed_rows[r](token)
        self._run()
        return self.buf["logits"]

    def prefill(self, tokens: list[int], start: int, sequence=None, spent: dict | None = None):
        """Logits ``[vocab]`` of the last of ``tokens`` (at most the plan's ``rows``), fed at positions ``start …``
        of ``sequence`` (default: the plan's own cache), whose cache holds the positions before: what as many
        ``step``s give, bit for bit, the projections run once for all the tokens. A plan built with ``prefill``.
        Rows past the tokens repeat the last one at its position: they write the same keys and values to the same
        place, so that one plan serves every count up to its rows."""
        n = len(tokens)
        if not 0 < n <= self.rows or self.buf["logits"].shape[0] != 1:  # (a one-row decode plan is one)
            raise ValueError(f"a prefill plan of {self.rows} rows takes 1 to {self.rows} tokens, got {n}")
        for r in range(self.rows):
            self._place(r, tokens[min(r, n - 1)], start + min(r, n - 1), sequence)
        if self.rows >= PARALLEL_TABLE_ROWS:  # attend_rows: the rows past the tokens repeat the last
            for args in self.rows_positions[0]:
                args[self.slots[0] + 1] = n - 1
        runtime.apply_threads()
        for r in range(self.rows):
            self.embed_rows[r](tokens[min(r, n - 1)])
        self._run(spent)
        return self.buf["logits"][0]

    def _run(self, spent: dict | None = None) -> None:
        """The calls in order; with ``spent``, each timed into its kind's entry (``kind``)."""
        if spent is None:
            for fn, args in self.calls:
                fn(*args)
            return
        for fn, args in self.calls:
            t0 = time.perf_counter()
            fn(*args)
            took = time.perf_counter() - t0
            kind = self.kind(fn, args)
            spent[kind] = spent.get(kind, 0.0) + took

    def kind(self, fn, args) -> str:
        """What a call is, for a profile: the glue function, ``build_tables``, ``lut_gemv``/``lut_gemm``,
        ``quantize_rows``/``dot_gemm`` or a float projection, marked ``runtime.ON_POOL`` where it runs on the kernels'
        thread pool (the LUT and dot-product kernels; the tables of
        ``PARALLEL_TABLE_ROWS`` rows or more; attention over ``PARALLEL_ATTENTION_WORK`` or more)."""
        name = self.labels[id(fn)]
        if name == "attend":
            spec = self.glue_spec
            parallel = (args[self.slots[0]] + 1) * spec.n_heads * spec.head_dim >= PARALLEL_ATTENTION_WORK
        elif name == "build_tables":
            parallel = self.rows >= PARALLEL_TABLE_ROWS
        else:
            parallel = name.startswith(("lut_", "dot_")) or name.endswith(ROWS)
        return name + runtime.ON_POOL if parallel else name

    def _place(self, row: int, token: int, pos: int, sequence) -> None:
        """Point row ``row``'s attention at position ``pos`` of ``sequence`` (None: the plan's own cache), checked
        with ``token`` against the context and the vocabulary."""
        context = self.context if sequence is None else sequence.context
        if not 0 <= pos < context:
            raise ValueError(f"position {pos} is outside the context of {context} tokens")
        if not 0 <= token < self.vocab:
            raise ValueError(f"token id {token} is outside the vocabulary [0, {self.vocab})")
        caches = self.own_cache if sequence is None else self.sequence_handles(sequence)
        at_pos, at_keys, at_values = self.slots
        for args, (keys, values) in zip(self.rows_positions[row], caches):
            args[at_pos], args[at_keys], args[at_values] = pos, keys, values

    def sequence_handles(self, sequence) -> list[tuple]:
        """Per layer, the handles of ``sequence``'s keys and values."""
        raise NotImplementedError

    def profile(self, token: int, pos: int, rounds: int = 5) -> dict[str, float]:
        """Seconds per step in each kind of call (``kind``), each call timed in place, from the round whose calls
        sum lowest; ``"step"``: the fastest untimed step. Like ``step``, it writes the KV cache at ``pos``."""
        steps, splits = [], []
        self.step(token, pos)
        for _ in range(rounds):
            t0 = time.perf_counter()
            self.step(token, pos)
            steps.append(time.perf_counter() - t0)
            self.embed_rows[0](token)
            spent: dict[str, float] = {}
            self._run(spent)
            splits.append(spent)
        return {"step": min(steps), **min(splits, key=lambda d: sum(d.values()))}


PREFILL_ROWS_KEPT = 512  # rows of the prefill plans kept (two of a prompt's full chunks, ``PREFILL_CHUNK``)


def prefill_rows(tokens: int) -> int:
    """The rows of the prefill plan that feeds ``tokens`` tokens: an even count up to 16, then a multiple of 4. A
    prompt's rows are compute-bound lookups, each a row's worth of time: it pays at most one row it does not have
    up to 16 (which a GEMM tile of two rows computes anyway), three past (docs/decisions.md, "Prompts are prefilled
    through plans")."""
    return tokens + tokens % 2 if tokens <= 16 else -(-tokens // 4) * 4
