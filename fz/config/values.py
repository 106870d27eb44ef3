"""Typed values out of a DeepSpeed config: checks that name the key path in every error.

`zero_optimization.stage: 4 is not one of 0, 1, 2, 3`. `fz.config.reader.Reader` applies
them and keeps the bookkeeping.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from fz.errors import ConfigError, suggest

AUTO = "auto"
MISSING = object()
Check = Callable[[str, Any], Any]


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def got(v: Any) -> str:
    """How an error names a value of the wrong type: `the string "3"`, `true`, `2.5`."""
    if isinstance(v, str):
        return f'the string "{v}"'
    if isinstance(v, bool):
        return "true" if v else "false"
    return "null" if v is None else repr(v)


def integer(lo: int | None = None, hi: int | None = None) -> Check:
    """An int (JSON's 5e8 floats are fine when integral), within [lo, hi]."""

    def check(path: str, v: Any) -> int:
        if isinstance(v, float) and math.isfinite(v) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{path}: must be an integer, got {got(v)}")
        if lo is not None and v < lo:
            raise ConfigError(f"{path}: {v!r} must be >= {lo}")
        if hi is not None and v > hi:
            raise ConfigError(f"{path}: {v!r} must be <= {hi}")
        return v

    return check


def number(lo: float | None = None, hi: float | None = None, lo_open: bool = False,
           hi_open: bool = False, why: str = "") -> Check:
    """A finite int or float, within lo..hi (open ends where asked); `why`: what a value past them does."""
    why = f" ({why})" if why else ""

    def check(path: str, v: Any) -> float:
        if not _is_number(v):
            raise ConfigError(f"{path}: {v!r} must be a number")
        try:
            f = float(v)
        except OverflowError:
            raise ConfigError(f"{path}: {v!r} is too large") from None
        if not math.isfinite(f):
            raise ConfigError(f"{path}: {v!r} must be a finite number")
        if lo is not None and (f <= lo if lo_open else f < lo):
            raise ConfigError(f"{path}: {v!r} must be {'>' if lo_open else '>='} {lo}{why}")
        if hi is not None and (f >= hi if hi_open else f > hi):
            raise ConfigError(f"{path}: {v!r} must be {'<' if hi_open else '<='} {hi}{why}")
        return f

    return check


def boolean(path: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{path}: {v!r} must be true or false")
    return v


def string(path: str, v: Any) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"{path}: {v!r} must be a string")
    return v


def optional(check: Check) -> Check:
    return lambda path, v: None if v is None else check(path, v)


def choice(options: Sequence[Any]) -> Check:
    """One of `options` (exact match; bools never pass for ints)."""

    def check(path: str, v: Any) -> Any:
        for o in options:
            if type(v) is type(o) and v == o:
                return v
            if isinstance(o, int) and isinstance(v, float) and v.is_integer() and v == o:
                return o
        if all(type(o) is int for o in options) and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ConfigError(f"{path}: must be an integer, got {got(v)}")
        names = ", ".join(str(o) for o in options)
        hint = suggest(v, [str(o) for o in options]) if isinstance(v, str) else ""
        raise ConfigError(f"{path}: {v!r} is not one of {names}{hint}")

    return check


def betas(path: str, v: Any) -> tuple[float, float]:
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ConfigError(f"{path}: {v!r} must be a list of two numbers, e.g. [0.9, 0.999]")
    unit = number(0.0, 1.0, hi_open=True)
    return unit(f"{path}[0]", v[0]), unit(f"{path}[1]", v[1])


def section(path: str, v: Any) -> dict[str, Any]:
    """A JSON object with string keys."""
    if not isinstance(v, dict):
        raise ConfigError(f"{path}: expected an object ({{...}}), got {type(v).__name__} {v!r:.60}")
    for k in v:
        if not isinstance(k, str):
            raise ConfigError(f"{path}: key {k!r} is not a string")
    return v


def in_use(v: Any) -> bool:
    """Whether a DeepSpeed feature section is switched on: {"enabled": true}, non-empty, or truthy."""
    if isinstance(v, dict):
        return v.get("enabled", True) not in (False, None) if v else False
    return v not in (False, None, 0, "", "none", [])
