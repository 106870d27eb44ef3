"""fp16 dynamic loss scaling with DeepSpeed's semantics, as a pure function of the scaler state.

The scaler is a dict of 0-d tensors inside the State (so it is checkpointed):
`scale`, `iter` (steps seen), `last_overflow` (iter of the last overflow, -1 if none),
`hysteresis` (overflows still tolerated before the scale drops) and `skipped` (how many
steps an overflow skipped). Same arithmetic as DeepSpeed's DynamicLossScaler.update_scale.
In fp32 and bf16 it holds only `skipped`: the steps a non-finite gradient skipped
(Spec.nonfinite="skip", fz/step/nonfinite.py), counted and checkpointed in every precision.
"""
from __future__ import annotations

import torch
from torch import Tensor

from fz.spec import Spec

Scaler = dict[str, Tensor]


def init_scaler(spec: Spec) -> Scaler:
    """The initial scaler state: the loss scaler in fp16; in fp32 and bf16 only the skip count."""
    if spec.precision != "fp16":
        return {"skipped": torch.tensor(0, dtype=torch.int64)}
    ls = spec.loss_scaling
    scale = ls.loss_scale if ls.loss_scale > 0 else 2.0 ** ls.initial_scale_power
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return {"scale": torch.tensor(float(scale)), "iter": i64(0), "last_overflow": i64(-1),
            "hysteresis": i64(ls.hysteresis), "skipped": i64(0)}


def update_scaler(spec: Spec, scaler: Scaler, overflow: bool) -> Scaler:
    """The scaler after one step that did (not) overflow (was skipped, without a loss scale)."""
    if "scale" not in scaler:
        return {"skipped": torch.tensor(int(scaler["skipped"]) + int(overflow), dtype=torch.int64)}
    ls = spec.loss_scaling
    scale, it = float(scaler["scale"]), int(scaler["iter"])
    last, hyst, skipped = int(scaler["last_overflow"]), int(scaler["hysteresis"]), int(scaler["skipped"])
    dynamic = ls.loss_scale == 0
    if overflow:
        skipped += 1
        if dynamic:
            if ls.hysteresis == 1 or hyst == 1:
                scale = max(scale / 2.0, ls.min_loss_scale)
            else:
                hyst -= 1
        last = it
    elif dynamic:
        if ls.consecutive_hysteresis:
            hyst = ls.hysteresis
        if (it - last) % ls.loss_scale_window == 0:
            if not ls.consecutive_hysteresis:
                hyst = ls.hysteresis
            scale *= 2.0
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return {"scale": torch.tensor(scale), "iter": i64(it + 1), "last_overflow": i64(last),
            "hysteresis": i64(hyst), "skipped": i64(skipped)}
