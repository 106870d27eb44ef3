"""The counts, sizes and scales a DeepSpeed checkpoint's fields hold, checked before they are used.

A step, a world size, a stage or a shape is whatever the file says: inf, 2**70, -5, "12" or 6.7
would otherwise end as a raw OverflowError far from its cause, or pass as a wrong number (the
string "64" read as the shape (6, 4), 6.7 truncated to 6). DeepSpeed writes these as ints (a
shape as a torch.Size, or a list of ints; Adam's step as a float tensor holding an integer), so
each is held to that and to a range. A failure is a CheckpointError naming the file, the field
and the value.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fz.ckpt.deepspeed import unpickle as ds_pickle
from fz.ckpt.deepspeed.unpickle import Lazy
from fz.errors import CheckpointError
from fz.state import MAX_STEPS

LIMIT = 2**63 - 1  # what an int64 holds
_DIMS = 64  # torch's most dimensions
_FP32_MAX = 3.4028234663852886e38


def short(x: Any) -> str:
    """`x`'s repr, cut to 60 characters (a hostile value may be long)."""
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def _scalar(x: Any) -> Any:
    """A one-element tensor as its number (Adam's step, a scale); anything else as it is."""
    if isinstance(x, Lazy) and x.numel == 1:
        return ds_pickle.materialize(x).item()
    return x


def integer(value: Any, file: Path | str, field: str, *, lo: int = 0, hi: int = MAX_STEPS,
            floats: bool = False) -> int:
    """`value` as an int from `lo` to `hi` (default fz.state.MAX_STEPS: a step or count, a size):
    a Python int (not a bool, not a string); with `floats` also a finite float holding an integer,
    or a one-element tensor of one (Adam's step)."""
    x = _scalar(value) if floats else value
    whole = type(x) is int or (floats and type(x) is float and math.isfinite(x) and x.is_integer())
    if not whole or not lo <= x <= hi:
        raise CheckpointError(f"DeepSpeed checkpoint file {file}: its {field} is {short(x)}, not an integer "
                              f"from {lo} to {hi}: damaged or not written by DeepSpeed")
    return int(x)


def optional(value: Any, default: int, file: Path | str, field: str, **kw: Any) -> int:
    """`integer(value)`, or `default` where the field is absent (None)."""
    return default if value is None else integer(value, file, field, **kw)


def shape(value: Any, file: Path | str, field: str) -> tuple[int, ...]:
    """A shape: a tuple (a torch.Size) or list of at most 64 non-negative ints whose product fits an int64."""
    if not isinstance(value, tuple | list) or len(value) > _DIMS:
        raise CheckpointError(f"DeepSpeed checkpoint file {file}: its {field} is {short(value)}, not a shape (a "
                              f"list of up to {_DIMS} non-negative ints): damaged or not written by DeepSpeed")
    out = tuple(integer(d, file, f"{field}[{i}]") for i, d in enumerate(value))
    if math.prod(out) > LIMIT:
        raise CheckpointError(f"DeepSpeed checkpoint file {file}: its {field} {short(out)} has more than 2**63 "
                              "elements: damaged")
    return out


def scale(value: Any, file: Path | str, field: str) -> float:
    """A loss scale: a number > 0 that a float32 holds (0 would divide by zero; NaN, inf or a
    negative one skips every step). DeepSpeed writes an int (2**16) or a float."""
    x = _scalar(value)
    if type(x) not in (int, float) or not 0 < x <= _FP32_MAX:  # NaN compares False
        raise CheckpointError(f"DeepSpeed checkpoint file {file}: its {field} is {short(x)}, not a finite number "
                              "> 0: damaged (training from it would divide by it, or skip every step)")
    return float(x)


def mapping(value: Any, file: Path | str, field: str) -> dict | None:
    """A field that is a dict (a config section, a state_dict) or absent (None)."""
    if value is not None and not isinstance(value, dict):
        raise CheckpointError(f"DeepSpeed checkpoint file {file}: its {field} is {short(value)}, not a dict: "
                              "damaged or not written by DeepSpeed")
    return value


def param_shapes(groups: Any, file: Path | str) -> list[dict[str, tuple[int, ...]]]:
    """param_shapes: per parameter group, {name: shape}, each checked."""
    if not isinstance(groups, list):
        raise CheckpointError(f"DeepSpeed checkpoint file {file}: its param_shapes is {short(groups)}, not a list "
                              "of {name: shape}: damaged or not written by DeepSpeed")
    checked = [mapping(g, file, "param_shapes") or {} for g in groups]
    return [{str(k): shape(v, file, f"param_shapes[{k!r}]") for k, v in g.items()} for g in checked]


def paddings(value: Any, groups: int, file: Path | str) -> list[int]:
    """ZeRO 1/2's group_paddings: one count per parameter group (absent: none), each an int >= 0."""
    if value is None or value == []:
        return [0] * groups
    if not isinstance(value, list | tuple) or len(value) != groups:
        raise CheckpointError(f"DeepSpeed checkpoint file {file}: its group_paddings is {short(value)}, not a list of "
                              f"{groups} counts (one per parameter group): damaged or not written by DeepSpeed")
    return [integer(p, file, f"group_paddings[{i}]") for i, p in enumerate(value)]


def aliases(value: Any, file: Path | str) -> dict[str, str]:
    """shared_params: {the name of a tied parameter: the name of the one stored}, or absent."""
    pairs = mapping(value, file, "shared_params") or {}
    for k, v in pairs.items():
        if not (isinstance(k, str) and isinstance(v, str)):
            raise CheckpointError(f"DeepSpeed checkpoint file {file}: its shared_params[{short(k)}] is {short(v)}, not "
                                  "a pair of parameter names: damaged or not written by DeepSpeed")
    return dict(pairs)
