"""A training progress bar (steps, loss, tokens/s, ETA) for rank 0's terminal.

It draws only on a terminal (or when forced), so logs and files get the monitor's
plain lines instead of carriage returns.
"""
from __future__ import annotations

import time
from typing import TextIO


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Bar:
    """`show(step, text)` after each step; `write(line)` prints a line above it; `close()` ends it."""

    def __init__(self, total: int | None, stream: TextIO, enabled: bool | None = None, start_step: int = 0):
        self.total, self.stream = total, stream
        self.enabled = bool(stream.isatty()) if enabled is None else enabled
        self.start, self.first, self.last, self.shown = time.perf_counter(), start_step, 0.0, ""

    def show(self, step: int, text: str) -> None:
        now = time.perf_counter()
        if not self.enabled or (now - self.last < 0.1 and step != self.total):
            return
        self.last = now
        done = step - self.first
        if self.total:
            frac = min(1.0, step / self.total)
            left = (self.total - step) * (now - self.start) / max(done, 1)
            head = f"{step}/{self.total} [{'#' * int(24 * frac):<24}] "
            tail = f"  ETA {_clock(left)}"
        else:
            head, tail = f"step {step} ", f"  {_clock(now - self.start)}"
        self._draw(head + text + tail)

    def write(self, line: str) -> None:
        if self.enabled and self.shown:
            self.stream.write("\r\x1b[2K")
        self.stream.write(line + "\n")
        if self.enabled and self.shown:
            self.stream.write(self.shown)
        self.stream.flush()

    def _draw(self, line: str) -> None:
        self.shown = line
        self.stream.write("\r\x1b[2K" + line)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.shown:
            self.stream.write("\n")
            self.stream.flush()
        self.shown = ""
