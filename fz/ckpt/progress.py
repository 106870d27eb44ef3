"""A dependency-free progress bar on stderr for long CLI work (silent when not a terminal
unless forced, so logs and tests stay clean)."""
from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """`Progress(total, "consolidate")`, then `update(n)` per unit done and `close()`."""

    def __init__(self, total: int, label: str, *, enabled: bool | None = None, stream: TextIO = sys.stderr):
        self.total, self.label, self.done, self.stream = max(1, total), label, 0, stream
        self.enabled = stream.isatty() if enabled is None else enabled
        self.start = self.last = time.perf_counter()

    def update(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if self.enabled and now - self.last > 0.2:
            self.last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(1.0, self.done / self.total)
        bar = "#" * int(30 * frac)
        rate = self.done / max(now - self.start, 1e-9) / 2**20
        self.stream.write(f"\r{self.label} [{bar:<30}] {100 * frac:5.1f}% {rate:7.1f} MB/s")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()
