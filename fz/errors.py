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
