"""`zero_optimization` -> the Spec's stage, bucket, persistence, prefetch and live-bucket sizes.

Sizes are DeepSpeed's element counts; fz counts buckets, so a size becomes a number of
buckets (a positive prefetch size is at least one block, as DeepSpeed prefetches). "auto"
sizes are filled as the Hugging Face Trainer fills them from the model's hidden size h
(`hidden_size=`): reduce_bucket_size h*h, and at stage 3 stage3_prefetch_bucket_size
0.9*h*h and stage3_param_persistence_threshold 10*h; without it they take fz's defaults.
Offload sections are read by fz/config/offload.py.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from fz.config import keys as K
from fz.config.offload import read_offload
from fz.config.reader import Reader
from fz.config.values import AUTO, MISSING, choice, integer
from fz.errors import ConfigError

PATH = "zero_optimization"
# key -> (the Trainer's "auto" value from the hidden size h, only at stage 3?)
HIDDEN: dict[str, tuple[Callable[[int], int], bool]] = {
    "reduce_bucket_size": (lambda h: h * h, False),
    "stage3_prefetch_bucket_size": (lambda h: int(0.9 * h * h), True),
    "stage3_param_persistence_threshold": (lambda h: 10 * h, True),
}


def read_zero(r: Reader, cfg: dict[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    raw = cfg.get(PATH)
    if isinstance(raw, bool):  # DeepSpeed's deprecated form: true means stage 1
        zero, stage, src = {}, int(raw), "config"
        r.mark(PATH, "mapped", f"deprecated boolean form: stage {stage}")
    else:
        zero = r.section("", cfg, PATH)
        r.check_keys(PATH, zero, K.ZERO_USED, K.ZERO_IGNORED, K.ZERO_UNSUPPORTED)
        stage, src = r.get(PATH, zero, "stage", choice((0, 1, 2, 3)), 0)
    out["stage"] = stage
    r.record("stage", stage, src, f"{PATH}.stage")
    policy = read_offload(r, cfg, zero, stage)
    if policy is not None:
        out["offload"] = policy
    sizes = {k: v for k, v in (_elements(r, zero, (k,), stage) for k in ("reduce_bucket_size", "allgather_bucket_size"))
             if v is not None and k is not None}
    for size_key, value in sizes.items():
        if value < 1:
            raise ConfigError(f"{size_key}: {value!r} must be >= 1")
    if sizes:  # one bucket size in fz: the smaller respects both limits
        size_key = min(sizes, key=lambda k: sizes[k])
        out["bucket_mb"] = sizes[size_key] * 4 / 2**20
        r.record("bucket_mb", out["bucket_mb"], _source(r, size_key), f"{size_key} * 4 / 2**20")
    _note_auto(r, zero, "bucket_mb", ("reduce_bucket_size", "allgather_bucket_size"))
    bucket_elems = out.get("bucket_mb", r.default("bucket_mb")) * 2**20 / 4

    mics, src = r.get(PATH, zero, "mics_shard_size", integer(-1, 2**31), -1)
    if mics == 0 or mics < -1:
        raise ConfigError(f"{PATH}.mics_shard_size: {mics!r} must be -1 (off) or a group size >= 1")
    if mics != -1:  # MiCS: shard within groups of this many ranks, replicate across them
        out["shard_group_size"] = mics
        r.record("shard_group_size", mics, src, f"{PATH}.mics_shard_size")

    names = ("stage3_param_persistence_threshold", "param_persistence_threshold")
    key, persist = _elements(r, zero, names, stage)
    if persist is not None:
        out["persist_threshold"] = persist
        r.record("persist_threshold", persist, _source(r, key), key)
    _note_auto(r, zero, "persist_threshold", names)

    names = ("stage3_prefetch_bucket_size", "prefetch_bucket_size")
    key, prefetch = _elements(r, zero, names, stage)
    if "prefetch" not in fields:
        if key is not None:
            r.mark(key, "ignored", "this fz has no prefetch")
    elif prefetch is not None:  # round up: a positive size prefetches at least one block
        out["prefetch"] = math.ceil(prefetch / bucket_elems)
        r.record("prefetch", out["prefetch"], _source(r, key), f"{key} / bucket elements, rounded up")
    else:
        _note_auto(r, zero, "prefetch", names)
    min_live = 2 + out.get("prefetch", r.default("prefetch") if "prefetch" in fields else 0)

    key, live = _elements(r, zero, ("stage3_max_live_parameters", "max_live_parameters"), stage)
    if live is not None:
        out["live_buckets"] = max(min_live, int(live // bucket_elems))
        r.record("live_buckets", out["live_buckets"], "config", f"{key} // bucket elements (>= {min_live})")
    elif r.default("live_buckets") < min_live:
        out["live_buckets"] = min_live
        r.record("live_buckets", min_live, "config", "2 + prefetch")
    return out


def _source(r: Reader, key: str | None) -> str:
    return "auto" if key is not None and r.outcomes.get(key, ("",))[0] == "auto" else "config"


def _elements(r: Reader, zero: dict[str, Any], names: tuple[str, ...],
              stage: int) -> tuple[str | None, int | None]:
    """(key path, element count) under the first of `names` present (the others are ignored);
    "auto" or null: (path, None) unless the hidden size fills it as the Trainer would."""
    found: tuple[str | None, int | None] = (None, None)
    for name in names:
        if name not in zero:
            continue
        path = f"{PATH}.{name}"
        if found[0] is not None:
            r.mark(path, "ignored", f"{found[0]} is used")
            continue
        fill, stage3 = HIDDEN.get(name, (None, False))
        if zero[name] == AUTO and fill is not None and (stage == 3 or not stage3):
            h = r.keyword("hidden_size")
            if h is not MISSING:
                r.mark(path, "auto", f"hidden_size={h}: {fill(h)}")
                found = path, fill(h)
                continue
        value, _ = r.get(PATH, zero, name, integer(0, 2**62), None, auto_value=None)
        found = path, value
    return found


def _note_auto(r: Reader, zero: dict[str, Any], field: str, names: tuple[str, ...]) -> None:
    """Record an "auto" tuning size as fz's default, so explain() shows where it went."""
    if field in r.entries:
        return
    for name in names:
        if zero.get(name) == AUTO:
            r.record(field, r.default(field), "default", f'{PATH}.{name} ("auto")')
            return
