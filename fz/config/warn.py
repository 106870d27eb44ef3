"""What a load tells the user at once: DeepSpeed settings fz accepts but does not honour.

Unsupported features that are switched on (curriculum learning,
random-LTD, sparse attention, ...) and top-level keys neither DeepSpeed nor fz knows are
named in one DeepSpeedConfigWarning per load (the warnings module shows a given message
once); `strict=True` makes them one ConfigError instead. `Spec.explain()` lists every key.
"""
from __future__ import annotations

import warnings

from fz.errors import ConfigError


class DeepSpeedConfigWarning(UserWarning):
    """A DeepSpeed setting fz accepts without honouring it (training differs), or a doubtful value."""


def report(outcomes: dict[str, tuple[str, str]], unknown: list[str], advice: list[str], origin: str,
           strict: bool, stacklevel: int = 4) -> None:
    """Warn (or with `strict`, raise) naming each unsupported key in `outcomes` and each unknown key."""
    unsupported = [f"{p} ({note})" if note else p for p, (o, note) in outcomes.items() if o == "unsupported"]
    parts = []
    if unsupported:
        parts.append("fz does not implement " + "; ".join(unsupported)
                     + ". These are IGNORED: training differs from DeepSpeed's")
    if unknown:
        parts.append("keys neither DeepSpeed nor fz knows, ignored: " + ", ".join(unknown))
    if parts and strict:
        raise ConfigError(f"DeepSpeed config {origin} (strict=True): " + ". ".join(parts))
    if parts:
        warnings.warn(f"DeepSpeed config {origin}: " + ". ".join(parts)
                      + " (strict=True makes this an error; spec.explain() lists every key)",
                      DeepSpeedConfigWarning, stacklevel=stacklevel)
    for text in advice:
        warnings.warn(f"DeepSpeed config {origin}: {text}", DeepSpeedConfigWarning, stacklevel=stacklevel)
