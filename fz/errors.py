"""The one error type users catch: every bad input fz detects raises it."""
from __future__ import annotations

import difflib
from typing import Iterable


class ConfigError(ValueError):
    """A spec, batch, model or checkpoint that fz cannot use; the message names the cause."""


def suggest(name: str, valid: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest valid name, or ''."""
    close = difflib.get_close_matches(name, list(valid), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


class NonFiniteError(FloatingPointError):
    """A NaN or inf reached the gradients under Spec(nonfinite="raise"): raised on every rank, naming
    the step and the first offending parameter; the state given to the step is left unchanged."""


class PeerError(RuntimeError):
    """Another rank stopped answering (died, frozen) or left a collective: raised on every rank that
    waits for it, naming the lost rank(s) when they can be told and what this rank was doing."""

    def __init__(self, message: str, ranks=(), step=None):
        super().__init__(message)
        self.ranks, self.step = tuple(ranks), step
