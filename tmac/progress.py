"""A dependency-free progress line on stderr for long work (conversion, quantization, compiling, tuning)."""

from __future__ import annotations

import sys
import time


class Progress:
    """``with Progress("quantizing", total) as p: ... p.advance(label)`` — redraws one stderr line, at most
    10 times a second; silent when ``enabled`` is False (default: only when stderr is a terminal)."""

    def __init__(self, what: str, total: int, enabled: bool | None = None, stream=None):
        self.what, self.total, self.done = what, total, 0
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._start = self._drawn = time.perf_counter()

    def __enter__(self) -> "Progress":
        return self

    def advance(self, label: str = "", n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self.enabled and (now - self._drawn > 0.1 or self.done == self.total):
            self._drawn = now
            width = 24
            filled = min(width, width * self.done // max(self.total, 1))  # a total may be an estimate
            self.stream.write(f"\r{self.what} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                              f"{now - self._start:5.1f}s {label[:40]:<40}")
            self.stream.flush()

    def __exit__(self, *exc) -> None:
        if self.enabled and self.total:
            self.stream.write("\n")
            self.stream.flush()
