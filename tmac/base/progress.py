"""A dependency-free progress line on stderr for long work (conversion, quantization, compiling, tuning)."""

from __future__ import annotations

import sys
import time


class Progress:
    """``with Progress("quantizing", total) as p: ... p.advance(label)`` — on a terminal, redraws one stderr line at
    most 10 times a second; into a file or pipe (a log), writes a line a step, at most two a second and the last,
    never a carriage-return frame. Silent when ``enabled`` is False (default: only on a terminal; the command line's
    long commands pass True)."""

    def __init__(self, what: str, total: int, enabled: bool | None = None, stream=None):
        self.what, self.total, self.done = what, total, 0
        self.stream = stream or sys.stderr
        self.terminal = _isatty(self.stream)
        self.enabled = self.terminal if enabled is None else enabled
        self._start = self._drawn = time.perf_counter()

    def __enter__(self) -> "Progress":
        return self

    def advance(self, label: str = "", n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        last = self.done == self.total
        if not self.enabled or not (last or now - self._drawn > (0.1 if self.terminal else 0.5)):
            return
        self._drawn = now
        if self.terminal:
            width = 24
            filled = min(width, width * self.done // max(self.total, 1))  # a total may be an estimate
            self.stream.write(f"\r{self.what} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                              f"{now - self._start:5.1f}s {label[:40]:<40}")
        else:
            self.stream.write(f"{self.what}: {self.done}/{self.total} {now - self._start:.1f}s {label[:60]}".rstrip()
                              + "\n")
        self.stream.flush()

    def __exit__(self, *exc) -> None:
        if self.enabled and self.total and self.terminal:
            self.stream.write("\n")
            self.stream.flush()


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
