"""`Reader`: one load of a DeepSpeed config, with the bookkeeping `Spec.explain()` prints.

It fills values from the keyword arguments the way the Hugging Face Trainer does (a
keyword fills its key when the key is "auto", and here also when it is absent; an explicit
value that disagrees with the keyword is an error naming both), records where each Spec
value came from, and keeps one outcome for every DeepSpeed key of the input:

  mapped       read into the Spec
  auto         "auto", filled from a keyword or with fz's default
  ignored      accepted, no effect in fz (tunes DeepSpeed internals, a feature that is off,
               null, a comment or a key DeepSpeed does not know either)
  unsupported  a DeepSpeed feature in use that fz does not implement: warned at load
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from fz.config.values import AUTO, MISSING, Check, join, section
from fz.errors import ConfigError, suggest

OUTCOMES = ("mapped", "auto", "ignored", "unsupported")


def same(a: Any, b: Any) -> bool:
    """Config value vs keyword: 1 == 1.0, [0.9, 0.99] == (0.9, 0.99)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


class Reader:
    """Reads values out of config sections, filling "auto" from the keyword arguments."""

    def __init__(self, auto: dict[str, Any], defaults: dict[str, Any] | None = None):
        self.auto = auto
        self.defaults = dict(defaults or {})  # Spec field -> its default
        self.used_auto: set = set()
        self.entries: dict[str, tuple[Any, str]] = {}  # name -> (value, source)
        self.keys: dict[str, str] = {}  # name -> DeepSpeed key path it came from
        self.outcomes: dict[str, tuple[str, str]] = {}  # DeepSpeed key path -> (outcome, note); the last wins
        self.unknown: list[str] = []  # top-level keys neither DeepSpeed nor fz knows
        self.advice: list[str] = []  # warnings about values fz honours (DeepSpeed warns too)

    def default(self, field: str) -> Any:
        return self.defaults.get(field)

    def record(self, name: str, value: Any, source: str, key: str | None = "") -> None:
        self.entries[name] = (value, source)
        if key:
            self.keys[name] = key

    def mark(self, path: str, outcome: str, note: str = "") -> None:
        assert outcome in OUTCOMES, outcome
        self.outcomes[path] = (outcome, note)

    def with_outcome(self, outcome: str) -> list[str]:
        return [p for p, (o, _) in self.outcomes.items() if o == outcome]

    def keyword(self, name: str | None) -> Any:
        """The keyword's value (marked used), or MISSING."""
        if name is None or name not in self.auto:
            return MISSING
        self.used_auto.add(name)
        return self.auto[name]

    def agree(self, path: str, value: Any, name: str | None) -> None:
        """An explicit config value must match the keyword that would fill it (HF raises too)."""
        kw = self.keyword(name)
        if kw is not MISSING and not same(value, kw):
            raise ConfigError(f"{path}: the config says {value!r} but the keyword {name}={kw!r}; they contradict "
                              f'(make them equal, drop the keyword, or set the key to "auto")')

    def section(self, path: str, d: dict[str, Any], key: str) -> dict[str, Any]:
        """d[key] as a section: {} when absent; null or {} is marked ignored."""
        full = join(path, key)
        raw = d.get(key)
        if key in d and (raw is None or raw == {}):
            self.mark(full, "ignored", "null" if raw is None else "empty")
        return section(full, {} if raw is None else raw)

    def check_keys(self, path: str, d: dict[str, Any], used: Iterable[str], ignored: Iterable[str] = (),
                   unsupported: dict[str, Callable[[Any], bool]] | None = None, note: str = "") -> None:
        """Unknown keys are errors (DeepSpeed's sections forbid them too); ignored keys and
        unsupported features are marked (an unsupported one that is off counts as ignored)."""
        used, ignored, unsupported = set(used), set(ignored), dict(unsupported or {})
        valid = used | ignored | set(unsupported)
        for k, v in d.items():
            if k not in valid:
                raise ConfigError(f"{join(path, k)}: unknown DeepSpeed key{suggest(k, sorted(valid))}")
            if k in unsupported:
                on = unsupported[k](v)
                self.mark(join(path, k), "unsupported" if on else "ignored", note if on else "off")
            elif k in ignored:
                self.mark(join(path, k), "ignored")

    def read_elsewhere(self, cfg: dict[str, Any], keys: dict[str, str]) -> None:
        """Keys a shell reads from the config itself (`keys`: path -> who), marked so, not ignored (a
        section ignored whole, one key of which is read, is marked key by key)."""
        for path, note in keys.items():
            top, _, key = path.partition(".")
            section = cfg.get(top)
            if key and self.outcomes.get(top, ("",))[0] == "ignored" and isinstance(section, dict) and key in section:
                del self.outcomes[top]
                self.ignore_all(top, section, "")
            if self.outcomes.get(path, ("",))[0] == "ignored":
                self.mark(path, "mapped", note)

    def ignore_all(self, path: str, raw: Any, note: str) -> None:
        """Every key of a section fz does not read (or the key itself) is ignored."""
        if isinstance(raw, dict) and raw:
            for k in raw:
                self.mark(join(path, str(k)), "ignored", note)
        else:
            self.mark(path, "ignored", note)

    def get(self, path: str, d: dict[str, Any], key: str, check: Check, default: Any = MISSING,
            auto: str | None = None, auto_value: Any = MISSING, auto_note: str = "fz's default") -> tuple[Any, str]:
        """(value, source). Keyword `auto` fills an "auto" or absent key and must agree with an
        explicit one; an "auto" without it takes `auto_value`, else is an error."""
        full = join(path, key)
        if key not in d or d[key] is None and default is not MISSING:
            if key in d:
                self.mark(full, "ignored", "null")
            kw = self.keyword(auto)
            if kw is not MISSING:
                return kw, "auto"
            if default is MISSING:
                raise ConfigError(f"{full}: required key is missing")
            return default, "default"
        v = d[key]
        if isinstance(v, str) and v == AUTO:
            kw = self.keyword(auto)
            if kw is not MISSING:
                self.mark(full, "auto", f"{auto}={kw!r}")
                return kw, "auto"
            if auto_value is not MISSING:
                self.mark(full, "auto", auto_note)
                return auto_value, "default"
            how = f"pass {auto}=... to Spec.from_deepspeed" if auto else "fz has no keyword to fill it; set a value"
            raise ConfigError(f'{full}: "auto" is left without a value ({how})')
        value = check(full, v)
        self.agree(full, value, auto)
        self.mark(full, "mapped")
        return value, "config"


def key_order(cfg: dict[str, Any], prefix: str = "", out: dict[str, int] | None = None) -> dict[str, int]:
    """Every key path of the input, numbered in reading order (explain() lists keys so)."""
    out = {} if out is None else out
    for k, v in cfg.items():
        path = f"{prefix}.{k}" if prefix else str(k)
        out[path] = len(out)
        if isinstance(v, dict):
            key_order(v, path, out)
    return out
