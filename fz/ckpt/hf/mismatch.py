"""What leads an error about weights that do not fit a model: weights of another size of model
(other shapes, or a config.json beside them with other sizes) are said first, with the sizes of
the model's config and of theirs, before the names that differ, a few of each kind. That
config.json is read as any file of a downloaded folder: a regular file inside it, bounded in size
and in depth (a FIFO or a symlink out of the folder is refused, never read)."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from fz.ckpt.hf.cache import in_folder
from fz.ckpt.hf.names import Match
from fz.ckpt.regular import parse_json, read_small
from fz.errors import CheckpointError

_MAX_CONFIG = 16 << 20  # bytes: a transformers config.json is a few KiB
_SIZE = re.compile(r"size|dim|layer|head|vocab|embd|position|expert", re.I)


def sizes(config: Any) -> dict[str, int]:
    """The integer sizes of a transformers config (or its config.json as a dict): hidden_size,
    num_hidden_layers, vocab_size, ..."""
    d = config.to_dict() if hasattr(config, "to_dict") else config
    if not isinstance(d, dict):
        return {}
    return {k: v for k, v in d.items() if isinstance(v, int) and not isinstance(v, bool) and _SIZE.search(k)}


def _theirs(path: str | os.PathLike[str]) -> tuple[Path, dict[str, int]]:
    """(config.json beside the weights, its sizes; empty when there is none or it is not JSON). One
    that is not a regular file, leads out of the folder, is over _MAX_CONFIG bytes or nests too
    deep is a CheckpointError naming it."""
    p = Path(path)
    cfg = (p if p.is_dir() else p.parent) / "config.json"
    if not os.path.lexists(cfg):
        return cfg, {}
    what = "config.json beside the weights"
    try:
        raw = read_small(in_folder(cfg.parent, cfg, what), _MAX_CONFIG, what)
        return cfg, sizes(parse_json(raw, f"{what} {cfg}"))
    except CheckpointError:
        raise
    except (OSError, ValueError):
        return cfg, {}


def _listed(d: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items())


def lead(path: str | os.PathLike[str], model: Any, m: Match) -> str | None:
    """Why the weights do not fit when they are of another size of model; None otherwise (then
    the names that differ say it)."""
    have = sizes(getattr(model, "config", None))
    cfg, theirs = _theirs(path)
    differ = [k for k in have if k in theirs and theirs[k] != have[k]]
    if differ:
        return (f"they are of another size of model: {cfg} has {_listed({k: theirs[k] for k in differ})}, this "
                f"model's config {_listed({k: have[k] for k in differ})}. Build the model from that config "
                f"(transformers: AutoConfig.from_pretrained({str(cfg.parent)!r})), or load weights of this size")
    if not m.mismatched:
        return None
    shapes = f"{len(m.mismatched)} tensor(s) have other shapes than this model's (e.g. {m.mismatched[0]})"
    if have:
        return (f"{shapes}: they are of another size of model than this model's config ({_listed(have)}). Build "
                "the model with the sizes the weights were saved at (their config.json), or load weights of this size")
    return f"{shapes}: they are of another size of model. Build it with the sizes the weights were saved at"


def listed(m: Match, shown: int = 8) -> str:
    """The differences, shape mismatches first, about `shown` in all: a few of each kind (so 40
    missing names do not hide the one mismatch that says why), with how many more there are."""
    kinds = [(k, v) for k, v in (("shape mismatch", m.mismatched), ("missing", m.missing),
                                 ("unexpected", m.unexpected)) if v]
    each = max(shown // max(len(kinds), 1), 2)
    out: list[str] = []
    for kind, names in kinds:
        out += [f"{kind}: {n}" for n in names[:each]]
        if len(names) > each:
            out.append(f"... {len(names) - each} more {kind}")
    return "; ".join(out)
