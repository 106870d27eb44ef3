"""The building blocks optimizers are chained from; each runs on local shards."""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Union

import torch
from torch import Tensor

from fz.optim.base import GradientTransformation, Params, global_norm, lr_at

LR = Union[float, Callable[[int], float]]


class CountState(NamedTuple):
    count: Tensor  # 0-d int64 on the CPU: how many updates have been applied


def _count0() -> Tensor:
    return torch.zeros((), dtype=torch.int64)


def _lists(updates: Params, *trees: Params):
    keys = list(updates)
    return keys, [updates[k] for k in keys], [[t[k] for k in keys] for t in trees]


class AdamState(NamedTuple):
    count: Tensor
    mu: Params
    nu: Params


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam's bias-corrected m / (sqrt(v) + eps), the same arithmetic as torch.optim.Adam."""

    def init(params: Params) -> AdamState:
        zeros = lambda: {k: torch.zeros_like(p) for k, p in params.items()}  # noqa: E731
        return AdamState(_count0(), zeros(), zeros())

    def update(updates: Params, state: AdamState, params: Optional[Params] = None):
        count = state.count + 1
        t = int(count)
        keys, g, (m, v) = _lists(updates, state.mu, state.nu)
        torch._foreach_lerp_(m, g, 1 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, g, g, value=1 - b2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, math.sqrt(1 - b2**t))
        torch._foreach_add_(denom, eps)
        out = torch._foreach_div(m, denom)
        torch._foreach_mul_(out, 1 / (1 - b1**t))
        return dict(zip(keys, out)), AdamState(count, state.mu, state.nu)

    return GradientTransformation(init, update)


def add_decayed_weights(weight_decay: float) -> GradientTransformation:
    """updates += weight_decay * params (decoupled decay when chained before the lr)."""

    def init(params: Params) -> tuple:
        return ()

    def update(updates: Params, state: tuple, params: Optional[Params] = None):
        if weight_decay:
            if params is None:
                raise ValueError("add_decayed_weights needs params")
            keys, u, (p,) = _lists(updates, params)
            torch._foreach_add_(u, p, alpha=weight_decay)
        return updates, state

    return GradientTransformation(init, update)


def scale_by_learning_rate(lr: LR) -> GradientTransformation:
    """updates *= -lr(step); `lr` is a number or a schedule."""

    def init(params: Params) -> CountState:
        return CountState(_count0())

    def update(updates: Params, state: CountState, params: Optional[Params] = None):
        torch._foreach_mul_(list(updates.values()), -lr_at(lr, int(state.count)))
        return updates, CountState(state.count + 1)

    return GradientTransformation(init, update)


class TraceState(NamedTuple):
    trace: Params


def trace(momentum: float, nesterov: bool = False) -> GradientTransformation:
    """Heavy-ball momentum as torch.optim.SGD computes it (dampening 0)."""

    def init(params: Params) -> TraceState:
        return TraceState({k: torch.zeros_like(p) for k, p in params.items()})

    def update(updates: Params, state: TraceState, params: Optional[Params] = None):
        keys, g, (buf,) = _lists(updates, state.trace)
        torch._foreach_mul_(buf, momentum)
        torch._foreach_add_(buf, g)
        if nesterov:
            torch._foreach_add_(g, buf, alpha=momentum)
        else:
            torch._foreach_copy_(g, buf)  # the updates, not the trace, get scaled next
        return updates, state

    return GradientTransformation(init, update)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale updates so their global L2 norm (over all shards) is at most max_norm."""

    def init(params: Params) -> tuple:
        return ()

    def update(updates: Params, state: tuple, params: Optional[Params] = None):
        norm = global_norm(updates)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(list(updates.values()), coef)
        return updates, state

    return GradientTransformation(init, update)
