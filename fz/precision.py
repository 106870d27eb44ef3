"""Precision settings: the compute dtypes fz knows and fp16 loss scaling (DeepSpeed's `fp16` keys)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fz.errors import ConfigError

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MAX_SCALE_POWER = 64  # a loss scale past 2**64 overflows every fp16 gradient (fp16's largest value is 65504)
MAX_LOSS_SCALE = 2.0 ** MAX_SCALE_POWER  # nor does dynamic scaling grow past it (kept as fp32: finite)


@dataclass(frozen=True)
class LossScale:
    """fp16 loss scaling, with DeepSpeed's `fp16` keys and meanings.

    `loss_scale` 0 means dynamic: start at 2**initial_scale_power, halve on an overflow
    after `hysteresis` overflows, double after `loss_scale_window` clean steps, never
    below `min_loss_scale`. A positive `loss_scale` is a fixed scale.
    """

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    raise_at_min: bool = False
    """Stop the run (NonFiniteError) at an overflow once the scale is at `min_loss_scale` and no
    hysteresis is left, as DeepSpeed's ZeRO 1-3 loss scaler does; otherwise such steps are skipped
    (up to Spec.skip_limit in a row)."""
    growth: Literal["deepspeed", "grad_scaler"] = "deepspeed"
    """When a clean run doubles the scale. "deepspeed": as DeepSpeed's DynamicLossScaler (0.19), once
    `loss_scale_window` steps have passed without overflow after the step that follows the last
    overflow (window + 1 clean steps first, then every window); "grad_scaler": as torch.amp.GradScaler
    (the Trainer's fp16), at every `loss_scale_window`-th clean step in a row."""

    def __post_init__(self) -> None:
        if not 0 <= self.loss_scale <= MAX_LOSS_SCALE:
            raise ConfigError(f"LossScale.loss_scale={self.loss_scale!r}: must be 0 (dynamic) or > 0, at most 2**"
                              f"{MAX_SCALE_POWER} (a larger one overflows every fp16 gradient)")
        if not 0 <= self.initial_scale_power <= MAX_SCALE_POWER:
            raise ConfigError(f"LossScale.initial_scale_power={self.initial_scale_power!r}: must be from 0 to "
                              f"{MAX_SCALE_POWER} (a larger one overflows every fp16 gradient)")
        if self.loss_scale_window < 1 or self.hysteresis < 1:
            raise ConfigError("LossScale.loss_scale_window and hysteresis must be >= 1")
        if self.min_loss_scale <= 0:
            raise ConfigError(f"LossScale.min_loss_scale={self.min_loss_scale!r}: must be > 0")
