"""The error types users catch: every bad input fz detects raises ConfigError (CheckpointError for a checkpoint)."""
from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A spec, batch, model or checkpoint that fz cannot use; the message names the cause."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used or written: missing, damaged, unreadable, unsigned or
    signed with another key, or a save that failed (a full disk, a rank's I/O error). Caught
    apart from a wrong setting (`except fz.CheckpointError`: e.g. start fresh when there is no
    checkpoint yet); still a ConfigError, so code that catches that keeps working."""


def suggest(name: str, valid: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest valid name, or ''."""
    close = difflib.get_close_matches(name, list(valid), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


class OffloadError(OSError):
    """An offload file that does not read back as it was written (a block's checksum differs, or the
    file is short): named with the byte range. The state holding it is unusable; the job restores
    from its last checkpoint, which lives in other files and is untouched."""


class NonFiniteError(FloatingPointError):
    """A NaN or inf where training cannot go on from it, raised on every rank alike: in the gradients
    under Spec(nonfinite="raise"), or in the Spec.skip_limit-th skipped step in a row (naming the
    step and the first offending parameter; the state given to the step is left unchanged); or in
    the weights a load reads (naming the tensors; allow_nonfinite=True makes it a warning)."""


class PeerError(RuntimeError):
    """Another rank stopped answering (died, frozen) or left a collective: raised on every rank that
    waits for it, naming the lost rank(s) when they can be told and what this rank was doing."""

    def __init__(self, message: str, ranks: Iterable[int] = (), step: int | None = None):
        super().__init__(message)
        self.ranks, self.step = tuple(ranks), step
