"""fp16 dynamic loss scaling with DeepSpeed's semantics, as a pure function of the scaler state.

The scaler is a dict of 0-d tensors inside the State (so it is checkpointed):
`scale`, `iter` (steps seen), `last_overflow` (iter of the last overflow, -1 if none),
`hysteresis` (overflows still tolerated before the scale drops) and `skipped` (how many
steps an overflow skipped). Same arithmetic as DeepSpeed's DynamicLossScaler.update_scale.
In fp32 and bf16 it holds only `skipped`: the steps a non-finite gradient skipped
(Spec.nonfinite="skip", fz/step/nonfinite.py), counted and checkpointed in every precision.
In every precision `skipped_in_a_row` counts the skipped steps since the last update, for
Spec.skip_limit: in the state, so it is checkpointed and equal on every rank (the skip is agreed).
"""
from __future__ import annotations

import torch
from torch import Tensor

from fz.precision import MAX_LOSS_SCALE
from fz.spec import Spec

Scaler = dict[str, Tensor]
IN_A_ROW = "skipped_in_a_row"


def init_scaler(spec: Spec) -> Scaler:
    """The initial scaler state: the loss scaler in fp16; in fp32 and bf16 only the skip counts."""
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    if spec.precision != "fp16":
        return {"skipped": i64(0), IN_A_ROW: i64(0)}
    ls = spec.loss_scaling
    scale = ls.loss_scale if ls.loss_scale > 0 else 2.0 ** ls.initial_scale_power
    return {"scale": torch.tensor(float(scale)), "iter": i64(0), "last_overflow": i64(-1),
            "hysteresis": i64(ls.hysteresis), "skipped": i64(0), IN_A_ROW: i64(0)}


def skipped_in_a_row(scaler: Scaler) -> int:
    """Steps skipped since the last update (0 for a state saved before fz counted them)."""
    return int(scaler[IN_A_ROW]) if IN_A_ROW in scaler else 0


def update_scaler(spec: Spec, scaler: Scaler, overflow: bool) -> Scaler:
    """The scaler after one step that did (not) overflow (was skipped, without a loss scale)."""
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    in_a_row = i64(skipped_in_a_row(scaler) + 1 if overflow else 0)
    if "scale" not in scaler:
        return {"skipped": i64(int(scaler["skipped"]) + int(overflow)), IN_A_ROW: in_a_row}
    ls = spec.loss_scaling
    scale, it = float(scaler["scale"]), int(scaler["iter"])
    last, hyst, skipped = int(scaler["last_overflow"]), int(scaler["hysteresis"]), int(scaler["skipped"])
    dynamic = ls.loss_scale == 0
    if overflow:
        skipped += 1
        if dynamic:
            if ls.hysteresis == 1 or hyst <= 1:
                scale = max(scale / 2.0, ls.min_loss_scale)
            else:
                hyst -= 1
        last = it
    elif dynamic:
        if ls.consecutive_hysteresis:
            hyst = ls.hysteresis
        clean = it - last if ls.growth == "grad_scaler" else it - last - 1  # DeepSpeed's stable_interval
        if clean > 0 and clean % ls.loss_scale_window == 0:
            if not ls.consecutive_hysteresis:
                hyst = ls.hysteresis
            scale = min(scale * 2.0, MAX_LOSS_SCALE)  # never inf: an fp32 tensor holds it
    return {"scale": torch.tensor(scale), "iter": i64(it + 1), "last_overflow": i64(last),
            "hysteresis": i64(hyst), "skipped": i64(skipped), IN_A_ROW: in_a_row}
