"""`state.metrics`: what one step measured, as a leaf of the state it returned.

Kept in the state, not in shared objects, so two states stepped from one `init` never
affect each other, and `fz.comm_report` / the monitor read a state, not a plan. Every
state has the same keys (a fresh one holds zeros and NaNs), so states share a treedef.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

COMM_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "scalar", "inter_all_reduce", "inter_scalar")
# copies between the host tier and the device, by direction and kind (Comm.h2d / Comm.d2h)
TRANSFER_KINDS = ("h2d_forward", "h2d_recompute", "h2d_other", "d2h_grads", "d2h_other")


def _i64(v: int) -> Tensor:
    return torch.tensor(v, dtype=torch.int64)


def initial_metrics(lr: float | None = None, loss_scale: float = 1.0) -> dict[str, Any]:
    return {
        "order": torch.zeros(0, dtype=torch.int64),  # units in forward call order (stage 3 prefetches by it)
        "comm": {k: _i64(0) for k in COMM_KINDS},  # payload bytes of each collective kind
        "transfers": {k: _i64(0) for k in TRANSFER_KINDS},  # bytes between host tier and device
        "grad_norm": torch.tensor(math.nan),  # global norm before clipping (NaN: not clipped)
        "lr": torch.tensor(math.nan if lr is None else lr, dtype=torch.float64),
        "loss_scale": torch.tensor(float(loss_scale)),
        "skipped": _i64(0),  # steps a non-finite gradient (fp16: an overflow) skipped so far
        "live_buckets": _i64(0),  # stage 3: most gathered buckets alive at once during the step
        "unprefetched": _i64(0),  # stage 3: gathers that found no prefetch in flight
        "live_at_end": _i64(0),  # stage 3: gathered buckets still alive when the step returned (0)
    }


def step_metrics(order: Sequence[int], comm, live, norm: Tensor | None, lr: float | None,
                 scaler: dict[str, Tensor] | None) -> dict[str, Any]:
    out = initial_metrics(lr, float(scaler["scale"]) if scaler is not None and "scale" in scaler else 1.0)
    out["order"] = torch.tensor(list(order), dtype=torch.int64)
    for k in COMM_KINDS:
        out["comm"][k] = _i64(int(comm.bytes.get(k, 0)))
    for k in TRANSFER_KINDS:
        direction, kind = k.split("_", 1)
        out["transfers"][k] = _i64(int(getattr(comm, direction).get(kind, 0)))
    if norm is not None:
        out["grad_norm"] = norm.detach().float().reshape(())
    if scaler is not None:
        out["skipped"] = scaler["skipped"].clone()
    out["live_buckets"] = _i64(live.max_buckets)
    out["unprefetched"] = _i64(live.unprefetched)
    out["live_at_end"] = _i64(live.buckets)
    return out
