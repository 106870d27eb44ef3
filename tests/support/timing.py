"""Wall-time bounds that hold on a busy machine: what a quiet machine needs, scaled by how much
slower this one runs now, measured while the test runs (never a bare constant).

    with Slowdown() as slow:                      # measured as the work starts and as it ends
        took = run_the_job()
    assert took < peers.PROBE + slow.margin()     # MARGIN_S on a quiet machine, more on a busy one

A loop that only computes takes as long in wall time as in CPU time where a core is free; on a
machine whose cores are all busy it waits for one, and its wall time over its CPU time is how
much longer everything waits (two busy processes on two cores: about 1.5). The bound of a test
that measured a time on a quiet machine, times that factor, holds there too.
"""
from __future__ import annotations

import time
from typing import Any

MARGIN_S = 10.0  # process start, exit and scheduling on a quiet machine of 2 cores


def slowdown(cpu_s: float = 0.1, pieces: int = 5) -> float:
    """How many times longer than on a quiet machine CPU-bound work takes here now (>= 1): the
    wall time of `pieces` short busy loops over their CPU time, spread over a few tenths of a second."""
    wall = cpu = 0.0
    for _ in range(pieces):
        w0, c0 = time.perf_counter(), time.thread_time()
        while time.thread_time() - c0 < cpu_s / pieces:
            pass
        wall += time.perf_counter() - w0
        cpu += time.thread_time() - c0
        time.sleep(0.02)
    return max(1.0, wall / cpu)


class Slowdown:
    """The slowdown as a piece of work starts and as it ends, the largest over every use (the work's
    own processes are not counted: a quiet machine's bound already has them). tests/conftest.py's
    module-scoped `load` fixture is one, for the fixture that runs what a module's tests assert on.
    """

    def __init__(self) -> None:
        self.factor = 1.0

    def start(self) -> Slowdown:
        self.factor = max(self.factor, slowdown())
        return self

    def stop(self) -> None:
        self.factor = max(self.factor, slowdown())

    def __enter__(self) -> Slowdown:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def scaled(self, quiet_s: float) -> float:
        """`quiet_s`, a bound that holds on a quiet machine, for this machine now."""
        return quiet_s * self.factor

    def margin(self, quiet_s: float = MARGIN_S) -> float:
        return self.scaled(quiet_s)

    def __repr__(self) -> str:
        return f"Slowdown(x{self.factor:.2f})"
