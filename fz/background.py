"""Work fz finishes in the background (async checkpoint saves) never fails silently.

Whoever starts such work registers a check that raises a failure that has already
happened (each one once). fz's entry points (init, train_step, eval_step, apply, saves and
restores) run the checks first, so the failure surfaces at the next fz call on that rank;
one still unreported at interpreter exit ends the process with a non-zero status
(fz/ckpt/checkpointer.py).
"""
from __future__ import annotations

from collections.abc import Callable

_checks: list[Callable[[], None]] = []


def on_next_call(check: Callable[[], None]) -> None:
    """Run `check` (it raises a background failure, or returns) at every fz entry point."""
    _checks.append(check)


def raise_background_failures() -> None:
    for check in list(_checks):
        check()
