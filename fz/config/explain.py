"""Where each Spec value came from: `Provenance` (kept on the Spec) and `explain` (the report).

Sources: "config" (the DeepSpeed file, or computed from its values), "auto" (an "auto"
filled from a keyword argument, or detected like the world size), "default" (neither: fz's
default, or the DeepSpeed optimizer's own default for that optimizer). Then every key of
the input once, with its outcome (fz.config.reader: mapped, auto, ignored, unsupported).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

SOURCES = ("config", "auto", "default")
KEYS_HEADER = "DeepSpeed keys (each once: mapped / auto / ignored / unsupported = not in fz, warned at load):"


class Provenance(Mapping[str, tuple[Any, str]]):
    """name -> (value, source); also the DeepSpeed key of each name, and each input key's outcome."""

    def __init__(self, entries: dict[str, tuple[Any, str]], keys: dict[str, str],
                 outcomes: dict[str, tuple[str, str]] | None = None, unused_auto: Sequence[str] = (),
                 origin: str = "a dict", objects: dict[str, Any] | None = None,
                 order: dict[str, int] | None = None, kind: str = "DeepSpeed config"):
        self._entries = dict(entries)
        self.objects = dict(objects or {})  # name -> the object in the Spec, where the entry is a description
        self.ds_keys = dict(keys)  # name -> the DeepSpeed key it came from (not `keys`: Mapping's method)
        rank = dict(order or {})  # input key path -> position; keys not in the input go last
        self.outcomes: dict[str, tuple[str, str]] = dict(
            sorted((outcomes or {}).items(), key=lambda kv: rank.get(kv[0], len(rank))))
        self.unused_auto: list[str] = list(unused_auto)
        self.origin = origin
        self.kind = kind  # what the values were read from: explain's header ("TrainingArguments" from fz.hf)

    @property
    def ignored(self) -> list[str]:
        return [p for p, (o, _) in self.outcomes.items() if o == "ignored"]

    @property
    def unsupported(self) -> list[str]:
        return [p for p, (o, _) in self.outcomes.items() if o == "unsupported"]

    def __getitem__(self, name: str) -> tuple[Any, str]:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Provenance({len(self)} values from {self.origin})"


class Described(str):
    """A value recorded as the fz code that builds it (an optimizer): shown without quotes."""

    def __repr__(self) -> str:
        return str(self)


def _show(value: Any) -> str:
    if isinstance(value, tuple) and hasattr(value, "init") and hasattr(value, "update"):
        return "an fz.optim transformation"
    if callable(value) and hasattr(value, "__name__"):
        return f"{getattr(value, '__module__', '')}.{value.__name__}".lstrip(".")
    return repr(value)


def explain(spec: Any) -> str:
    """Every Spec value and where it came from, then the DeepSpeed keys fz ignored."""
    prov: Provenance | None = getattr(spec, "provenance", None)
    rows: list[tuple[str, str, str, str]] = []  # (name, source, DeepSpeed key, value)
    for f in dataclasses.fields(spec):
        if f.name == "provenance":
            continue
        value = getattr(spec, f.name)
        recorded = prov.objects.get(f.name, prov[f.name][0]) if prov is not None and f.name in prov else None
        if prov is not None and f.name in prov and recorded is not value and not _equal(recorded, value):
            source, key = "code", "(changed after from_deepspeed)"
        elif prov is not None and f.name in prov:
            value, source = prov[f.name]
            key = prov.ds_keys.get(f.name, "")
        else:
            default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
            source = "default" if default is not dataclasses.MISSING and _equal(value, default) else "code"
            key = ""
        rows.append((f.name, source, key, _show(value)))
    if prov is not None:
        for name, (value, source) in prov.items():
            if "." in name or name in ("world_size", "train_batch_size", "scheduler"):
                rows.append((f"  {name}", source, prov.ds_keys.get(name, ""), _show(value)))
    width = max(len(r[0]) for r in rows) + 2
    kwidth = max(len(r[2]) for r in rows) + 2 if prov is not None else 0
    head = "fz.Spec" + (f" from {prov.kind} {prov.origin}".rstrip() if prov is not None else "")
    column = "DeepSpeed key" if prov is None or prov.kind == "DeepSpeed config" else "from"
    lines = [head, f"{'field':<{width}}{'source':<9}{column if kwidth else '':<{kwidth}}value"]
    lines += [f"{n:<{width}}{s:<9}{k:<{kwidth}}{v}" for n, s, k, v in rows]
    if prov is not None and (prov.outcomes or prov.kind == "DeepSpeed config"):
        kw = max((len(p) for p in prov.outcomes), default=0) + 2
        lines.append(KEYS_HEADER)
        lines += [f"  {p:<{kw}}{o:<13}{note}".rstrip() for p, (o, note) in prov.outcomes.items()]
    if prov is not None and prov.unused_auto:
        lines.append("keywords the config had no use for: " + ", ".join(prov.unused_auto))
    return "\n".join(lines)


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values without a usable ==
        return a is b
