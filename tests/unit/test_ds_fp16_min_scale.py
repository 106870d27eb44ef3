"""fp16 at its floor, as DeepSpeed 0.19: its ZeRO 1-3 loss scaler raises "Current loss scale already
at minimum - cannot decrease scale anymore" at an overflow with the scale at min_loss_scale and no
hysteresis left (runtime/fp16/loss_scaler.py), where fz skipped up to Spec.skip_limit steps; its
ZeRO-0 fp16 optimizer (FP16_Optimizer) has no hysteresis and never raises. A DeepSpeed config now
reads into the same behaviour (LossScale.raise_at_min, hysteresis 1 at ZeRO 0, named in explain())."""
from __future__ import annotations

import math

import pytest
import torch

import fz


class Boom(torch.autograd.Function):
    """An inf gradient from a finite loss: the overflow the loss scaler is there for."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * math.inf


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x):
        return Boom.apply(self.lin(x))


def spec(stage: int) -> fz.Spec:
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
           "fp16": {"enabled": True, "initial_scale_power": 0, "min_loss_scale": 1, "hysteresis": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    return fz.Spec.from_deepspeed(cfg).replace(loss_fn=lambda m, x: m(x).float().square().mean())


def test_at_zero_1_an_overflow_at_the_floor_without_hysteresis_left_stops_the_run():
    state = fz.init(Net(), spec(1))
    state, _ = fz.train_step(state, torch.randn(2, 4))  # the first overflow uses up the hysteresis
    assert int(state.scaler["skipped"]) == 1 and float(state.scaler["scale"]) == 1.0
    with pytest.raises(fz.NonFiniteError, match=r"Current loss scale already at minimum - cannot decrease scale"):
        fz.train_step(state, torch.randn(2, 4))


def test_at_zero_0_there_is_no_hysteresis_and_the_run_goes_on_skipping():
    s = spec(0)
    assert s.loss_scaling.hysteresis == 1 and not s.loss_scaling.raise_at_min
    assert "fp16.hysteresis" in s.explain() and "halves at every overflow" in s.explain()
    state = fz.init(Net(), s)
    for _ in range(3):
        state, _ = fz.train_step(state, torch.randn(2, 4))
    assert int(state.scaler["skipped"]) == 3
