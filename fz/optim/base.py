"""Optax-style transformations: a pair of pure functions over dicts of tensors.

`init(params) -> state`; `update(updates, state, params=None, **extra) -> (updates, state)`.
Inputs are local shards. Like optax's `GradientTransformationExtraArgs`, whatever needs
other ranks comes in `extra`, explicitly:
- `norm_sq(tree) -> Tensor`: sum of squares over every shard (default: this rank's only);
- `shard_sum(tree) -> tree`: per-parameter partial sums -> whole-parameter sums (default: as is);
- `donate=True`: the caller gives up `updates` and `state` (as `jax.jit(donate_argnums)`
  does): the new values may be written into their buffers. Without it a transformation
  never modifies its inputs.
`step(grads, state, params, **extra)` is update + apply_updates (params updated in place),
with `cast=` the updated values copied into lower-precision tensors too; a transformation may
give it a faster kernel of the same meaning (adamw does: on the host, one pass for both).
"""
from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fz.errors import ConfigError

Params = dict[str, Tensor]
NormSq = Callable[[Params], Tensor]


@dataclass(frozen=True, eq=False)
class GradientTransformation:
    init: Callable[[Params], Any]
    update: Callable[..., tuple[Params, Any]]

    def step(self, grads: Params, state: Any, params: Params, *, cast: Params | None = None, **extra: Any) -> Any:
        """Apply one update to `params` in place; returns the new state. `cast`: {name: tensor}
        to receive the updated values in its own dtype (the bf16 parameters of fp32 masters); a
        transformation with a fused kernel may write them in the update's own pass."""
        updates, state = self.update(grads, state, params, **extra)
        apply_updates(params, updates)
        if cast:
            cast_into(cast, params)
        return state


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transformations in order; the state is the tuple of their states."""

    def init(params: Params) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def update(updates: Params, state: tuple, params: Params | None = None, **extra: Any) -> tuple[Params, tuple]:
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params, **extra)
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init, update)


def apply_updates(params: Params, updates: Params) -> None:
    """params += updates, in place, one fused op over all tensors."""
    keys = list(updates)
    torch._foreach_add_([params[k] for k in keys], [updates[k] for k in keys])


def cast_into(cast: Params, params: Params) -> None:
    """cast[k] = params[k] in cast[k]'s dtype, for every k of `cast`."""
    keys = list(cast)
    if keys:
        torch._foreach_copy_([cast[k] for k in keys], [params[k] for k in keys])


@dataclass(frozen=True)
class CastGroups:
    """Cast targets handed out a group at a time (a bucket each, in the update's order):
    `open(i)` gives group i's {name: tensor}, `close(i)` says they hold the update, so that
    their copy to the device runs while the next group is updated (fz/offload/landing.py)."""

    groups: list[list[str]]
    open: Callable[[int], Params]
    close: Callable[[int], None]


def cast_groups_into(groups: CastGroups | None, params: Params) -> None:
    """Every group of `groups` cast from `params` (already updated), one after another."""
    if groups is None:
        return
    for i in range(len(groups.groups)):
        cast_into(groups.open(i), params)
        groups.close(i)


def step_casting(tx: GradientTransformation, grads: Params, state: Any, params: Params, cast: Params,
                 grad_mul: Tensor | None = None, groups: CastGroups | None = None, **extra: Any) -> Any:
    """`tx.step`, with the updated `params` cast into `cast` and `groups` (in the update's pass
    where `tx` can: a group as soon as its parameters are updated); a transformation whose own
    `step` takes neither gets the copies after it. `grad_mul` (a 0-d tensor: the clip's factor)
    multiplies the gradients first: inside `tx.step` where it takes one (the host AdamW
    kernel's pass), else in place before it. The gradients are donated."""
    if grad_mul is not None:
        if _takes(type(tx).step, "grad_mul"):
            extra["grad_mul"] = grad_mul
        else:
            torch._foreach_mul_(list(grads.values()), grad_mul)
    if groups is not None and _takes(type(tx).step, "groups"):
        extra["groups"] = groups
        groups = None
    if cast and _takes(type(tx).step, "cast"):
        extra["cast"], cast = cast, {}
    state = tx.step(grads, state, params, **extra)
    cast_into(cast, params)
    cast_groups_into(groups, params)
    return state


@functools.lru_cache(maxsize=64)
def _takes(step: Callable[..., Any], name: str) -> bool:
    return name in inspect.signature(step).parameters


def owned(tensors: list[Tensor], donate: bool) -> list[Tensor]:
    """Buffers to write new values of `tensors` into: themselves when the caller donated them,
    else copies (so the caller's tensors never change)."""
    return tensors if donate else [t.clone() for t in tensors]


def local_norm_sq(tree: Params) -> Tensor:
    tensors = list(tree.values())
    if not tensors:
        return torch.zeros(())
    norms = torch._foreach_norm(tensors)
    return torch.stack(norms).square().sum()


def global_norm(tree: Params, norm_sq: NormSq | None = None) -> Tensor:
    """L2 norm over every element of every leaf, across all ranks' shards (`norm_sq` sums them)."""
    return (norm_sq or local_norm_sq)(tree).sqrt()


def sum_across_shards(partial: Params, shard_sum: Callable[[Params], Params] | None = None) -> Params:
    """{param name: partial sum over this rank's rows} -> the sum over the whole parameter.

    For statistics a sharded optimizer needs whole (LAMB's per-parameter norms,
    Adafactor's column means): one collective for all of them, through `shard_sum`.
    Parameters whose optimizer state is replicated come back unchanged.
    """
    return partial if shard_sum is None else shard_sum(partial)


LR_MAX = 1e4  # no optimizer trains with more; 1e300 (finite in Python) is inf in fp32 and in every weight
# no optimizer trains with more weight decay (Lion's, the largest, are ~10x AdamW's 0.1); 1e308 made every
# weight inf at the first update (decoupled decay multiplies it by 1 - lr * weight_decay)
WEIGHT_DECAY_MAX = 1e3
MOMENTUM_MAX = 1.0  # SGD's trace past it grows geometrically: 1e308 wrote inf at the first update
_EPS_RULE = ("must be > 0: Adam divides by sqrt(v) + eps, and a parameter with no gradient yet (an embedding row no "
             "batch used) would get 0 / 0 = NaN")


def check_settings(who: str, *, betas: tuple[float, ...] = (), eps: float | None = None,
                   weight_decay: float | None = None) -> None:
    """Settings that diverge or write NaN or inf into the weights (a beta of 1, an eps of 0, which torch
    takes, a weight decay past WEIGHT_DECAY_MAX), refused naming `who` ("adam", "lamb", or "")."""
    prefix = f"{who} " if who else ""
    for i, b in enumerate(betas):
        if not 0 <= b < 1:  # as torch.optim.Adam refuses it: a beta of 1 or more diverges
            raise ConfigError(f"{prefix}betas[{i}]={b!r}: must be in [0, 1)")
    if eps is not None and not 0 < eps < math.inf:
        raise ConfigError(f"{prefix}eps={eps!r}: {_EPS_RULE}")
    if weight_decay is not None and not 0 <= weight_decay <= WEIGHT_DECAY_MAX:
        raise ConfigError(f"{prefix}weight_decay={weight_decay!r}: must be a number from 0 to {WEIGHT_DECAY_MAX:g} "
                          "(no optimizer trains with more; a larger one writes inf into the weights)")


def decay_factor_check(lr: float, weight_decay: float, count: int) -> None:
    """Decoupled weight decay (and SGD's) multiplies each weight by 1 - lr * weight_decay: past 1 that
    flips its sign at every update, past 2 it also grows it, to inf within a few dozen."""
    if lr * weight_decay > 1:
        raise ConfigError(f"learning rate {lr!r} x weight_decay {weight_decay!r} = {lr * weight_decay:g} at update "
                          f"{count}: must be at most 1 (each update multiplies the weights by 1 - lr x weight_decay: "
                          "below 0 it flips their sign, below -1 they grow to inf)")


def lr_at(lr: float | Callable[[int], float], count: int) -> float:
    """A learning rate is a number or a schedule: a function of the step count. A NaN or inf
    one (any weight it touches would be NaN), one past LR_MAX (the update overflows into inf)
    and a negative number are ConfigErrors, as in torch."""
    value = float(lr(count)) if callable(lr) else float(lr)
    if not math.isfinite(value) or abs(value) > LR_MAX or (value < 0 and not callable(lr)):
        raise ConfigError(f"learning rate {value!r}" + (f" (the schedule's, at update {count})" if callable(lr) else "")
                          + f": it must be a finite number >= 0, at most {LR_MAX:g} (a larger one writes inf into the "
                          "weights)")
    return value


def masked(inner: GradientTransformation, names: frozenset[str]) -> GradientTransformation:
    """`inner` on the parameters named in `names` only (optax.masked); the others pass through."""

    def init(params: Params) -> Any:
        return inner.init({k: v for k, v in params.items() if k in names})

    def update(updates: Params, state: Any, params: Params | None = None, **extra: Any) -> tuple[Params, Any]:
        sub = {k: u for k, u in updates.items() if k in names}
        new, state = inner.update(sub, state, None if params is None else {k: params[k] for k in sub}, **extra)
        return {**updates, **new}, state

    return GradientTransformation(init, update)
