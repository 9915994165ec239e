"""The sampling options of a generation, written once (``SamplingParams``: each option's name, default, bounds,
help and aliases), and the sampler that applies them to a sequence's logits (``Sampler``).

The command line's flags, ``Session.generate``'s keywords and the server's request fields are all made from the
fields below. The defaults are llama.cpp's (chosen for chat): temperature 0.8, top-k 40, top-p 0.95, min-p 0.05;
``temperature=0`` is exact greedy. The order is llama.cpp's: logit bias, penalties (repeat over the last
``repeat_last_n`` tokens of prompt and answer; OpenAI's presence and frequency over the answer's), then top-k,
top-p, min-p, temperature, and a draw. Everything is computed in float64 on finite values: no option within its
bounds can make a probability NaN.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


MAX_STOPS, MAX_STOP_CHARS = 16, 1000


class SamplingError(ValueError):
    """An option out of its bounds or of the wrong type; ``option`` names it."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


def _option(default, help: str, kind: str, low=None, high=None, low_open: bool = False, aliases=(), flags=(),
            cli: bool = True, shown: str | None = None):
    """A field of ``SamplingParams``: ``kind`` is int, float, seed, stops, bias or bool; ``low``/``high`` its bounds
    (``low_open``: the low one excluded); ``aliases`` other keyword names users bring (Hugging Face's, llama.cpp's);
    ``flags`` the command line's short or extra spellings; ``shown``: the default in words (else its value)."""
    meta = dict(help=help, kind=kind, low=low, high=high, low_open=low_open, aliases=tuple(aliases),
                flags=tuple(flags), cli=cli, shown=shown if shown is not None else str(default))
    if isinstance(default, (list, dict, tuple)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class SamplingParams:
    """How one generation samples and when it stops. Construct with keywords (aliases accepted by ``make``);
    every value is checked here, and a bad one raises ``SamplingError`` naming the option."""

    max_tokens: int | None = _option(
        None, "tokens to generate at most", "int", low=0, aliases=("max_new_tokens", "n_predict"),
        flags=("-n", "--n-predict", "--max-new-tokens"), shown="until an end-of-generation token or the context ends")
    temperature: float = _option(0.8, "randomness; 0: greedy, always the likeliest token", "float", low=0.0,
                                 flags=("--temp",))
    top_k: int = _option(40, "sample from the k likeliest tokens; 0: all", "int", low=0)
    top_p: float = _option(0.95, "sample from the likeliest tokens whose probabilities add up to p; 1: all", "float",
                           low=0.0, high=1.0, low_open=True)
    min_p: float = _option(0.05, "drop tokens less likely than min_p times the likeliest; 0: off", "float", low=0.0,
                           high=1.0)
    repeat_penalty: float = _option(1.0, "divide the logits of the last repeat_last_n tokens by this (llama.cpp's); "
                                         "1: off", "float", low=0.0, low_open=True, aliases=("repetition_penalty",))
    repeat_last_n: int = _option(64, "tokens the repeat penalty looks back over", "int", low=0)
    presence_penalty: float = _option(0.0, "subtract this from the logit of each token in the answer (OpenAI's)",
                                      "float", low=-2.0, high=2.0)
    frequency_penalty: float = _option(0.0, "subtract this times its count in the answer from a token's logit "
                                            "(OpenAI's)", "float", low=-2.0, high=2.0)
    seed: int | None = _option(None, "the same seed, prompt and options give the same answer", "seed", low=0,
                               high=2 ** 63 - 1, shown="a random one")
    stop: tuple[str, ...] = _option((), "stop before this text (repeatable)", "stops", shown="none")
    logit_bias: dict[int, float] = _option({}, "add BIAS to token ID's logit, as ID=BIAS (repeatable; -100 bans it)",
                                           "bias", low=-100.0, high=100.0, shown="none")
    ignore_eos: bool = _option(False, "generate past the end-of-generation token (for benchmarks)", "bool",
                               shown="off")
    logprobs: int | None = _option(None, "also report each token's log-probability and the n likeliest "
                                         "alternatives'", "int", low=0, high=20, cli=False, shown="off")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _checked(f, getattr(self, f.name)))

    def __hash__(self):
        return hash(tuple((k, tuple(sorted(v.items())) if isinstance(v, dict) else v)
                          for k, v in dataclasses.asdict(self).items()))

    @classmethod
    def make(cls, params: "SamplingParams | None" = None, **options) -> "SamplingParams":
        """``params`` (default: the defaults) with ``options`` replaced, aliases (``max_new_tokens``,
        ``repetition_penalty``, ``n_predict``) taken as the options they name."""
        names = canonical_names(options)
        base = params if params is not None else cls()
        if not isinstance(base, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(base).__name__}")
        return dataclasses.replace(base, **names) if names else base

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, dict) else v)
                for k, v in dataclasses.asdict(self).items()}


OPTIONS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(SamplingParams)}
ALIASES: dict[str, str] = {a: f.name for f in OPTIONS.values() for a in f.metadata["aliases"]}


def canonical_names(options: dict) -> dict:
    """``options`` keyed by the options' own names; an unknown name is a ``TypeError`` saying the nearest."""
    out = {}
    for key, value in options.items():
        name = ALIASES.get(key, key)
        if name not in OPTIONS:
            near = difflib.get_close_matches(key, [*OPTIONS, *ALIASES], 1)
            raise TypeError(f"unknown sampling option {key!r}" + (f"; did you mean {near[0]!r}?" if near else ""))
        if name in out:
            raise TypeError(f"sampling option {name!r} given twice (as {key!r} too)")
        out[name] = value
    return out


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def described(name: str) -> str:
    """Option ``name``'s help with its default and bounds, for ``--help``."""
    meta = OPTIONS[name].metadata
    bounds = f"; {_bounds(meta)}" if meta["low"] is not None and meta["kind"] in ("int", "float") else ""
    return f"{meta['help']}{bounds} (default: {meta['shown']})"


def _bounds(meta) -> str:
    low, high = meta["low"], meta["high"]
    if high is None:
        return f"{'>' if meta['low_open'] else '>='} {low}"
    return f"in {'(' if meta['low_open'] else '['}{low}, {high}]"


def _checked(f: dataclasses.Field, v: Any):
    """``v`` as option ``f`` holds it (a float as float, stops as a tuple, bias keys as ints), or ``SamplingError``."""
    meta, name = f.metadata, f.name
    kind = meta["kind"]

    def fail(what: str):
        raise SamplingError(name, f"{name} must be {what}, got {v!r:.60}")

    def in_bounds(x) -> bool:
        low, high = meta["low"], meta["high"]
        return (low is None or (x > low if meta["low_open"] else x >= low)) and (high is None or x <= high)

    if kind in ("int", "seed"):
        if v is None and f.default is None:
            return None
        if type(v) is not int or not in_bounds(v):
            fail(f"an int {_bounds(meta)}" + (" or None" if f.default is None else ""))
        return v
    if kind == "float":
        if not _is_number(v) or not math.isfinite(v) or not in_bounds(v):
            fail(f"a finite number {_bounds(meta)}")
        return float(v)
    if kind == "bool":
        if type(v) is not bool:
            fail("true or false")
        return v
    if kind == "stops":
        stops = (v,) if isinstance(v, str) else v
        if stops is None:
            return ()
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
            fail("a string or a list of strings")
        if any(not s for s in stops):
            raise SamplingError(name, "stop strings must not be empty (an empty one would stop before the first "
                                      "token)")
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise SamplingError(name, f"stop: at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters "
                                      f"(each is matched against the text at every token)")
        return tuple(stops)
    if kind == "bias":
        if v is None:
            return {}
        if not isinstance(v, dict):
            fail("a mapping of token ids to numbers")
        out = {}
        for key, bias in v.items():
            token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
            if type(token) is not int or token < 0:
                raise SamplingError(name, f"{name}: {key!r:.40} is not a token id (an int >= 0)")
            if not _is_number(bias) or not math.isfinite(bias) or not in_bounds(bias):
                raise SamplingError(name, f"{name}[{key}] must be a number {_bounds(meta)}, got {bias!r:.40}")
            out[token] = float(bias)
        return out
    raise AssertionError(kind)


def check_for_vocabulary(params: SamplingParams, vocab: int) -> None:
    """Token ids of ``logit_bias`` inside the vocabulary."""
    bad = [t for t in params.logit_bias if t >= vocab]
    if bad:
        raise SamplingError("logit_bias", f"logit_bias names token ids outside the vocabulary [0, {vocab}): "
                                          f"{bad[:5]}")


class Sampler:
    """One sequence's sampling: ``params``, its random stream and the counts the penalties need. ``history`` is the
    sequence's tokens so far (prompt and answer); ``sample(logits)`` picks the next and records it."""

    def __init__(self, params: SamplingParams, history: list[int]):
        self.params = params
        self.history = list(history)
        self.answer: dict[int, int] = {}  # token → times in the answer
        self.rng = np.random.default_rng(params.seed)
        self._bias = (np.fromiter(params.logit_bias, np.int64), np.fromiter(params.logit_bias.values(), np.float64)) \
            if params.logit_bias else None

    def sample(self, logits) -> int:
        """The next token from ``logits`` (a 1-D float tensor or array of the vocabulary), recorded."""
        x = logits.numpy() if hasattr(logits, "numpy") else np.asarray(logits)
        token = self._pick(x)
        self.history.append(token)
        self.answer[token] = self.answer.get(token, 0) + 1
        return token

    def _adjusted(self, x: np.ndarray) -> np.ndarray | None:
        """The logits after bias and penalties, float64 and finite; None where nothing changes them."""
        p = self.params
        window = self.history[-p.repeat_last_n:] if p.repeat_last_n and p.repeat_penalty != 1.0 else ()
        counted = (p.presence_penalty or p.frequency_penalty) and self.answer
        if self._bias is None and not window and not counted:
            return None
        x = np.clip(x.astype(np.float64), -1e300, 1e300)  # (a NaN-free, inf-free start; bias may push far)
        if self._bias is not None:
            x[self._bias[0]] += self._bias[1]
        if window:
            seen = np.unique(np.asarray(window, np.int64))
            v = x[seen]
            x[seen] = np.where(v > 0, v / p.repeat_penalty, v * p.repeat_penalty)
        if counted:
            ids = np.fromiter(self.answer, np.int64)
            counts = np.fromiter(self.answer.values(), np.float64)
            x[ids] -= counts * p.frequency_penalty + p.presence_penalty
        return np.clip(x, -1e300, 1e300, out=x)

    def _pick(self, raw: np.ndarray) -> int:
        with np.errstate(over="ignore", under="ignore"):  # (overflow clipped, underflow 0: both as meant)
            return self._filtered(raw, self._adjusted(raw))

    def _filtered(self, raw: np.ndarray, x: np.ndarray | None) -> int:
        p = self.params
        if p.greedy:
            return int(np.argmax(raw if x is None else x))
        x = np.clip(raw.astype(np.float64), -1e300, 1e300) if x is None else x
        if 0 < p.top_k < x.size:
            cand = np.argpartition(-x, p.top_k - 1)[:p.top_k]
        else:
            cand = np.arange(x.size)
        xc = x[cand]
        top = xc.max()
        prob = np.exp(xc - top)
        prob /= prob.sum()  # over the candidates, as llama.cpp's top-p sees them
        if p.min_p > 0:  # (a superset of what top-p then min-p keep: those below min-p go either way)
            keep = prob >= p.min_p * prob.max()
            cand, xc, prob = cand[keep], xc[keep], prob[keep]
        order = np.argsort(-xc, kind="stable")
        cand, xc, prob = cand[order], xc[order], prob[order]
        if p.top_p < 1.0:  # the smallest prefix whose probabilities reach top_p
            before = np.cumsum(prob) - prob
            n = max(1, int(np.count_nonzero(before < p.top_p)))
            cand, xc = cand[:n], xc[:n]
        weights = np.exp((xc - xc[0]) / p.temperature)  # (≤ 0 over a positive temperature: no overflow, no NaN)
        cum = np.cumsum(weights)
        return int(cand[min(int(np.searchsorted(cum, self.rng.random() * cum[-1], side="right")), cand.size - 1)])


def logprobs(logits, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of ``token`` under ``logits`` (the model's, before any sampling option) and the ``top``
    likeliest tokens' with theirs."""
    x = (logits.numpy() if hasattr(logits, "numpy") else np.asarray(logits)).astype(np.float64)
    high = x.max()
    lse = high + math.log(float(np.exp(x - high).sum()))
    best = []
    if top:
        idx = np.argpartition(-x, top - 1)[:top] if top < x.size else np.arange(x.size)
        idx = idx[np.argsort(-x[idx], kind="stable")]
        best = [(int(i), float(x[i] - lse)) for i in idx]
    return float(x[token] - lse), best
