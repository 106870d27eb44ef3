"""Ready-made optimizers, as chains of transforms (optax's aliases)."""
from __future__ import annotations

from typing import Tuple

import torch

from fz.optim.base import GradientTransformation, Params, chain, lr_at
from fz.optim.transforms import LR, AdamState, add_decayed_weights, scale_by_adam, scale_by_learning_rate, trace


def adamw(lr: LR = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 0.01) -> GradientTransformation:
    """AdamW with decoupled weight decay, as torch.optim.AdamW.

    The chain is the definition; `fused` runs the same step as torch's fused AdamW kernel
    (one pass over each shard instead of a dozen) and keeps the chain's state layout.
    """
    t = chain(scale_by_adam(*betas, eps), add_decayed_weights(weight_decay), scale_by_learning_rate(lr))
    return t._replace(fused=_fused_adamw(lr, betas, eps, weight_decay))


def _fused_adamw(lr: LR, betas: Tuple[float, float], eps: float, weight_decay: float):
    def fused(grads: Params, state: tuple, params: Params) -> tuple:
        adam, decay, lr_state = state
        keys = list(grads)
        count = adam.count + 1
        value = lr_at(lr, int(lr_state.count))
        step = torch.tensor(float(count))
        torch._fused_adamw_([params[k] for k in keys], [grads[k] for k in keys], [adam.mu[k] for k in keys],
                            [adam.nu[k] for k in keys], [], [step] * len(keys), lr=value, beta1=betas[0],
                            beta2=betas[1], weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        lr_state.lr.fill_(value)
        return (AdamState(count, adam.mu, adam.nu), decay, type(lr_state)(lr_state.count + 1, lr_state.lr))

    return fused


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
