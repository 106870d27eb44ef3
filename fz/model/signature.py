"""Ranks agree on the spec and the model at `fz.init`, before any collective depends on them.

Ranks that build different models (a config read per rank, a branch on the rank) or pass
different Specs would otherwise meet at the first collective with buffers of different
sizes: a hang, a gloo size error, or silently wrong training. One digest per Spec field
and per model property (parameter names, shapes, dtypes and trainability; buffers)
goes through the replicated-value check (fz/sharding/replicated.py, one small all-gather
of a fixed number of int64s), so every rank raises together naming what differs.
The provenance may differ (it names the file each rank read), and the offload path (a
local disk per rank); functions compare by name.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

PER_RANK = {"provenance"}  # Spec fields allowed to differ between ranks


def _stable(value: Any) -> str:
    """repr without memory addresses (functions and closures compare by name) and without the
    fields a value declares per rank (`per_rank_fields`: an offload policy's path, as each rank
    may use a local disk of its own)."""
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))
    for name in getattr(type(value), "per_rank_fields", ()):
        text = text.replace(repr(getattr(value, name)), "<per-rank path>")
    return text


def _digest(text: str) -> Tensor:
    return torch.tensor(int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True))


def signature(spec: Any, model: nn.Module) -> dict[str, Tensor]:
    """{label: int64 digest}: the same labels on every rank (same fz), equal digests when equal."""
    out = {f"Spec.{f.name}": _digest(_stable(getattr(spec, f.name)))
           for f in dataclasses.fields(spec) if f.name not in PER_RANK}
    params = list(model.named_parameters(remove_duplicate=True))
    buffers = list(model.named_buffers(remove_duplicate=True))
    out["the model's parameter names"] = _digest(repr([n for n, _ in params]))
    out["the model's parameter shapes"] = _digest(repr([tuple(p.shape) for _, p in params]))
    out["the model's parameter dtypes and requires_grad"] = _digest(
        repr([(p.dtype, p.requires_grad) for _, p in params])
    )
    out["the model's buffers (names, shapes, dtypes)"] = _digest(
        repr([(n, tuple(b.shape), b.dtype) for n, b in buffers])
    )
    return out
