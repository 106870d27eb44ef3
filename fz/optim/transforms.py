"""The building blocks optimizers are chained from; each runs on local shards."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fz.errors import ConfigError
from fz.optim.base import (
    MOMENTUM_MAX,
    GradientTransformation,
    NormSq,
    Params,
    check_settings,
    decay_factor_check,
    global_norm,
    lr_at,
    owned,
)

LR = float | Callable[[int], float]


class CountState(NamedTuple):
    # 0-d int64 on the CPU: how many updates have been applied
    count: Tensor  # type: ignore[assignment]  # optax's name (checkpoints use it) shadows tuple.count


def _count0() -> Tensor:
    return torch.zeros((), dtype=torch.int64)


def _lists(updates: Params, *trees: Params) -> tuple[list[str], list[Tensor], list[list[Tensor]]]:
    keys = list(updates)
    return keys, [updates[k] for k in keys], [[t[k] for k in keys] for t in trees]


def _chunks(tensors: Sequence[Tensor], max_numel: int = 1 << 22) -> Iterator[tuple[int, int]]:
    """[lo, hi) index ranges of at most ~max_numel elements: bounds an update's scratch memory."""
    lo, size = 0, 0
    for i, t in enumerate(tensors):
        if size and size + t.numel() > max_numel:
            yield lo, i
            lo, size = i, 0
        size += t.numel()
    if lo < len(tensors):
        yield lo, len(tensors)


class AdamState(NamedTuple):
    count: Tensor  # type: ignore[assignment]  # optax's name (checkpoints use it) shadows tuple.count
    mu: Params
    nu: Params


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  bias_correction: bool = True) -> GradientTransformation:
    """Adam's bias-corrected m / (sqrt(v) + eps), the same arithmetic as torch.optim.Adam.

    `bias_correction=False` is DeepSpeed's FusedAdam option of that name: m / (sqrt(v) + eps).
    """
    check_settings("adam", betas=(b1, b2), eps=eps)

    def init(params: Params) -> AdamState:
        zeros = lambda: {k: torch.zeros_like(p) for k, p in params.items()}  # noqa: E731
        return AdamState(_count0(), zeros(), zeros())

    def update(updates: Params, state: AdamState, params: Params | None = None, *, donate: bool = False,
               **extra: Any) -> tuple[Params, AdamState]:
        count = state.count + 1
        t = int(count)
        keys, g, (m, v) = _lists(updates, state.mu, state.nu)
        g, m, v = owned(g, donate), owned(m, donate), owned(v, donate)
        torch._foreach_lerp_(m, g, 1 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, g, g, value=1 - b2)
        # the result overwrites the incoming gradients; only a chunk of `denom` is ever extra
        for lo, hi in _chunks(g):
            denom = torch._foreach_sqrt(v[lo:hi])
            if bias_correction:
                torch._foreach_div_(denom, math.sqrt(1 - b2**t))
            torch._foreach_add_(denom, eps)
            torch._foreach_copy_(g[lo:hi], m[lo:hi])
            torch._foreach_div_(g[lo:hi], denom)
            del denom
        if bias_correction:
            torch._foreach_mul_(g, 1 / (1 - b1**t))
        return dict(zip(keys, g)), AdamState(count, dict(zip(keys, m)), dict(zip(keys, v)))

    return GradientTransformation(init, update)


def add_decayed_weights(weight_decay: float) -> GradientTransformation:
    """updates += weight_decay * params (decoupled decay when chained before the lr)."""
    check_settings("", weight_decay=weight_decay)

    def init(params: Params) -> tuple:
        return ()

    def update(updates: Params, state: tuple, params: Params | None = None, *, donate: bool = False,
               **extra: Any) -> tuple[Params, tuple]:
        if weight_decay:
            if params is None:
                raise ValueError("add_decayed_weights needs params")
            keys, u, (p,) = _lists(updates, params)
            u = owned(u, donate)
            torch._foreach_add_(u, p, alpha=weight_decay)
            updates = dict(zip(keys, u))
        return updates, state

    return GradientTransformation(init, update)


class LearningRateState(NamedTuple):
    # 0-d int64: how many updates have been applied
    count: Tensor  # type: ignore[assignment]  # optax's name (checkpoints use it) shadows tuple.count
    lr: Tensor  # 0-d float64: the lr of the last update (before the first: the lr it will use)


def _lr0(value: float) -> Tensor:
    return torch.tensor(value, dtype=torch.float64)


def scale_by_learning_rate(lr: LR, weight_decay: float = 0.0) -> GradientTransformation:
    """updates *= -lr(count); `lr` is a number or a schedule of the updates applied so far.

    The state records the lr it applied, so `current_lr(opt_state)` can report it. `weight_decay`: that
    of an `add_decayed_weights` chained before it (AdamW's, Lion's, SGD's), which multiplies the weights
    by 1 - lr x weight_decay: an lr that takes that below 0 is refused at the update it reaches.
    """

    def init(params: Params) -> LearningRateState:
        return LearningRateState(_count0(), _lr0(lr_at(lr, 0)))

    def update(updates: Params, state: LearningRateState, params: Params | None = None, *,
               donate: bool = False, **extra: Any) -> tuple[Params, LearningRateState]:
        value = lr_at(lr, int(state.count))
        decay_factor_check(value, weight_decay, int(state.count))
        keys = list(updates)
        u = owned([updates[k] for k in keys], donate)
        torch._foreach_mul_(u, -value)
        return dict(zip(keys, u)), LearningRateState(state.count + 1, _lr0(value))

    return GradientTransformation(init, update)


def current_lr(opt_state: Any) -> float:
    """The learning rate the optimizer last applied, found anywhere in an optimizer state.

    Accepts `state.opt_state` (or a whole fz.State); the first learning-rate record in
    depth-first order wins. Before the first step it is the lr the first step will use.
    """
    if callable(getattr(opt_state, "check_alive", None)):
        opt_state.check_alive("fz.optim.current_lr")
    tree = getattr(opt_state, "opt_state", opt_state)
    if tree is None:
        raise ConfigError("fz.optim.current_lr: the optimizer state is None: a donated state's (fz.train_step "
                          "gave it up)? Read the state it returned")
    found = _find_lr(tree)
    if found is None:
        raise ValueError("no learning rate recorded in this optimizer state "
                         "(it needs scale_by_learning_rate or an optimizer that records its lr)")
    return float(found.to_local() if hasattr(found, "to_local") else found)


def _find_lr(tree: Any) -> Tensor | None:
    if isinstance(tree, tuple) and hasattr(tree, "_fields") and "lr" in tree._fields:
        value = tree[tree._fields.index("lr")]
        if isinstance(value, Tensor) and value.numel() == 1:
            return value
    children = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (tuple, list)) else ()
    for child in children:
        found = _find_lr(child)
        if found is not None:
            return found
    return None


class TraceState(NamedTuple):
    trace: Params


def trace(momentum: float, nesterov: bool = False) -> GradientTransformation:
    """Heavy-ball momentum as torch.optim.SGD computes it (dampening 0)."""
    if not 0 <= momentum <= MOMENTUM_MAX:
        raise ConfigError(f"momentum={momentum!r}: must be a number from 0 to {MOMENTUM_MAX:g} (a larger one "
                          "grows the trace at every update, to inf)")

    def init(params: Params) -> TraceState:
        return TraceState({k: torch.zeros_like(p) for k, p in params.items()})

    def update(updates: Params, state: TraceState, params: Params | None = None, *, donate: bool = False,
               **extra: Any) -> tuple[Params, TraceState]:
        keys, g, (buf,) = _lists(updates, state.trace)
        g, buf = owned(g, donate), owned(buf, donate)
        torch._foreach_mul_(buf, momentum)
        torch._foreach_add_(buf, g)
        if nesterov:
            torch._foreach_add_(g, buf, alpha=momentum)
        else:
            torch._foreach_copy_(g, buf)  # the updates, not the trace, get scaled next
        return dict(zip(keys, g)), TraceState(dict(zip(keys, buf)))

    return GradientTransformation(init, update)


def clip_factor(norm: Tensor, max_norm: float) -> Tensor:
    """What clipping to `max_norm` multiplies tensors of global norm `norm` by (torch's clip_grad_norm_)."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def scale_to_max_norm(tensors: list[Tensor], norm: Tensor, max_norm: float) -> None:
    """Scale `tensors` in place so that their norm `norm` becomes at most `max_norm` (torch's clip_grad_norm_)."""
    torch._foreach_mul_(tensors, clip_factor(norm, max_norm))


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale updates so their global L2 norm (over all shards) is at most max_norm."""

    def init(params: Params) -> tuple:
        return ()

    def update(updates: Params, state: tuple, params: Params | None = None, *, donate: bool = False,
               norm_sq: NormSq | None = None, **extra: Any) -> tuple[Params, tuple]:
        keys = list(updates)
        u = owned([updates[k] for k in keys], donate)
        scale_to_max_norm(u, global_norm(updates, norm_sq), max_norm)
        return dict(zip(keys, u)), state

    return GradientTransformation(init, update)


def restart_schedule(opt_state: Any) -> Any:
    """`opt_state` with every learning-rate schedule (`scale_by_learning_rate`'s count) back at its
    first update; the moments and Adam's bias-correction count kept. transformers' second
    `train()`: a new scheduler over the same optimizer."""
    if isinstance(opt_state, LearningRateState):
        return LearningRateState(torch.zeros_like(opt_state.count), opt_state.lr)
    if isinstance(opt_state, tuple) and hasattr(opt_state, "_fields"):
        return type(opt_state)(*(restart_schedule(x) for x in opt_state))
    if isinstance(opt_state, tuple | list):
        return type(opt_state)(restart_schedule(x) for x in opt_state)
    if isinstance(opt_state, dict):
        return {k: restart_schedule(v) for k, v in opt_state.items()}
    return opt_state
