"""Ready-made optimizers, as chains of transforms (optax's aliases)."""
from __future__ import annotations

from typing import Tuple

from fz.optim.base import GradientTransformation, chain
from fz.optim.transforms import LR, add_decayed_weights, scale_by_adam, scale_by_learning_rate, trace


def adamw(lr: LR = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 0.01) -> GradientTransformation:
    """AdamW with decoupled weight decay, as torch.optim.AdamW."""
    return chain(scale_by_adam(*betas, eps), add_decayed_weights(weight_decay), scale_by_learning_rate(lr))


def adam(lr: LR = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0) -> GradientTransformation:
    """Adam with L2 weight decay added to the gradient, as torch.optim.Adam."""
    return chain(add_decayed_weights(weight_decay), scale_by_adam(*betas, eps), scale_by_learning_rate(lr))


def sgd(lr: LR = 1e-2, momentum: float = 0.0, nesterov: bool = False,
        weight_decay: float = 0.0) -> GradientTransformation:
    """SGD with optional (Nesterov) momentum and L2 weight decay, as torch.optim.SGD."""
    if nesterov and momentum <= 0:
        raise ValueError("nesterov momentum needs momentum > 0")
    parts = [add_decayed_weights(weight_decay)]
    if momentum:
        parts.append(trace(momentum, nesterov))
    parts.append(scale_by_learning_rate(lr))
    return chain(*parts)
