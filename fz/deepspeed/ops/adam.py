"""`deepspeed.ops.adam.FusedAdam` and `DeepSpeedCPUAdam` on fz: the client optimizers DeepSpeed
scripts build, as torch's Adam with their arguments (`adam_w_mode` / `adamw_mode`, True by
default: decoupled weight decay, AdamW). `deepspeed.initialize(optimizer=...)` turns them into
fz's optimizer as it does torch's (fz/optim/from_torch.py); stepped by hand they are torch's
Adam or AdamW. What torch's Adam does not compute is refused, naming it: `bias_correction=False`
(DeepSpeed's kernels take it; fz's Adam always corrects) and `amsgrad` (DeepSpeed's refuse it too).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from fz.errors import ConfigError


def _check(name: str, bias_correction: bool, amsgrad: bool) -> None:
    if not bias_correction:
        raise ConfigError(f"deepspeed.ops.adam.{name}(bias_correction=False): fz's Adam always corrects the moments' "
                          "bias; leave it True")
    if amsgrad:
        raise ConfigError(f"deepspeed.ops.adam.{name}(amsgrad=True): not supported (nor by DeepSpeed's kernel)")


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's FusedAdam: Adam, or AdamW with `adam_w_mode=True` (its default)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
        _check(type(self).__name__, bias_correction, amsgrad)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode)
        self.adam_w_mode = adam_w_mode


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's CPU Adam: Adam, or AdamW with `adamw_mode=True` (its default); fz places the
    optimizer state where the config's offload says, as DeepSpeed's engine does."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True):
        _check(type(self).__name__, bias_correction, amsgrad)
        if not fp32_optimizer_states:
            raise ConfigError("deepspeed.ops.adam.DeepSpeedCPUAdam(fp32_optimizer_states=False): fz keeps Adam's "
                              "moments in fp32")
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adamw_mode)
        self.adam_w_mode = adamw_mode


__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
