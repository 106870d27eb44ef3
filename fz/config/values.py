"""Reading a DeepSpeed config: typed values with key paths, "auto" fill-ins, and bookkeeping.

Every error names the key path (`zero_optimization.stage: 4 is not one of 0, 1, 2, 3`).
`Reader` remembers where each value came from (config, auto, default) and which keys were
ignored or are not supported, for `Spec.explain()`.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from fz.errors import ConfigError, suggest

AUTO = "auto"
MISSING = object()
Check = Callable[[str, Any], Any]


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def integer(lo: Optional[int] = None, hi: Optional[int] = None) -> Check:
    """An int (JSON's 5e8 floats are fine when integral), within [lo, hi]."""

    def check(path: str, v: Any) -> int:
        if isinstance(v, float) and math.isfinite(v) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{path}: {v!r} must be an integer")
        if lo is not None and v < lo:
            raise ConfigError(f"{path}: {v!r} must be >= {lo}")
        if hi is not None and v > hi:
            raise ConfigError(f"{path}: {v!r} must be <= {hi}")
        return v

    return check


def number(lo: Optional[float] = None, hi: Optional[float] = None, lo_open: bool = False,
           hi_open: bool = False) -> Check:
    """A finite int or float, within lo..hi (open ends where asked)."""

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
            raise ConfigError(f"{path}: {v!r} must be {'>' if lo_open else '>='} {lo}")
        if hi is not None and (f >= hi if hi_open else f > hi):
            raise ConfigError(f"{path}: {v!r} must be {'<' if hi_open else '<='} {hi}")
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
        names = ", ".join(str(o) for o in options)
        hint = suggest(v, [str(o) for o in options]) if isinstance(v, str) else ""
        raise ConfigError(f"{path}: {v!r} is not one of {names}{hint}")

    return check


def betas(path: str, v: Any) -> Tuple[float, float]:
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ConfigError(f"{path}: {v!r} must be a list of two numbers, e.g. [0.9, 0.999]")
    unit = number(0.0, 1.0, hi_open=True)
    return unit(f"{path}[0]", v[0]), unit(f"{path}[1]", v[1])


def section(path: str, v: Any) -> Dict[str, Any]:
    """A JSON object with string keys."""
    if not isinstance(v, dict):
        raise ConfigError(f"{path}: expected an object ({{...}}), got {type(v).__name__} {v!r:.60}")
    for k in v:
        if not isinstance(k, str):
            raise ConfigError(f"{path}: key {k!r} is not a string")
    return v


class Reader:
    """Reads values out of config sections, filling "auto" from the keyword arguments."""

    def __init__(self, auto: Dict[str, Any], defaults: Optional[Dict[str, Any]] = None):
        self.auto = auto
        self.defaults = dict(defaults or {})  # Spec field -> its default
        self.used_auto: set = set()
        self.entries: Dict[str, Tuple[Any, str]] = {}  # name -> (value, source)
        self.keys: Dict[str, str] = {}  # name -> DeepSpeed key path it came from
        self.ignored: List[str] = []  # accepted, tunes DeepSpeed internals
        self.unsupported: List[str] = []  # accepted, a DeepSpeed feature fz lacks (ignored)

    def default(self, field: str) -> Any:
        return self.defaults.get(field)

    def record(self, name: str, value: Any, source: str, key: str = "") -> None:
        self.entries[name] = (value, source)
        if key:
            self.keys[name] = key

    def check_keys(self, path: str, d: Dict[str, Any], used: Iterable[str], ignored: Iterable[str] = (),
                   unsupported: Dict[str, Callable[[Any], bool]] | None = None) -> None:
        """Unknown keys are errors; ignored ones and unsupported features in use are listed."""
        used, ignored, unsupported = set(used), set(ignored), dict(unsupported or {})
        valid = used | ignored | set(unsupported)
        for k, v in d.items():
            if k not in valid:
                raise ConfigError(f"{join(path, k)}: unknown DeepSpeed key{suggest(k, sorted(valid))}")
            if k in unsupported:
                (self.unsupported if unsupported[k](v) else self.ignored).append(join(path, k))
            elif k in ignored:
                self.ignored.append(join(path, k))

    def get(self, path: str, d: Dict[str, Any], key: str, check: Check, default: Any = MISSING,
            auto: Optional[str] = None, auto_value: Any = MISSING) -> Tuple[Any, str]:
        """(value, source). "auto" takes keyword `auto`, else `auto_value`, else is an error."""
        full = join(path, key)
        if key not in d or d[key] is None and default is not MISSING:
            if default is MISSING:
                raise ConfigError(f"{full}: required key is missing")
            return default, "default"
        v = d[key]
        if isinstance(v, str) and v == AUTO:
            if auto is not None and auto in self.auto:
                self.used_auto.add(auto)
                return self.auto[auto], "auto"
            if auto_value is not MISSING:
                return auto_value, "default"
            how = f"pass {auto}=... to Spec.from_deepspeed" if auto else "fz has no keyword to fill it; set a value"
            raise ConfigError(f'{full}: "auto" is left without a value ({how})')
        return check(full, v), "config"


def in_use(v: Any) -> bool:
    """Whether a DeepSpeed feature section is switched on: {"enabled": true}, non-empty, or truthy."""
    if isinstance(v, dict):
        return v.get("enabled", True) not in (False, None) if v else False
    return v not in (False, None, 0, "", "none", [])
