"""Optax-style transformations: a pair of pure-looking functions over dicts of tensors.

`init(params) -> state`; `update(updates, state, params) -> (updates, state)`.
Inputs are local shards: a transformation never communicates, except through
`global_norm`, which the step binds to the right process group.

Contract (for speed, like a donated buffer in JAX): `update` may modify the incoming
`updates` and the tensors of `state` in place and return them; it never modifies
`params`. fz copies the state first when the caller did not donate it.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Dict, Iterator, NamedTuple, Optional

import torch
from torch import Tensor

Params = Dict[str, Tensor]
NormSq = Callable[[Params], Tensor]


class GradientTransformation(NamedTuple):
    init: Callable[[Params], Any]
    update: Callable[..., "tuple[Params, Any]"]
    # Optional fast path with the same meaning as update + apply_updates, in one fused kernel:
    # fused(grads, state, params) -> new state, params updated in place. Same state layout.
    fused: Optional[Callable[..., Any]] = None


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transformations in order; the state is the tuple of their states."""

    def init(params: Params) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def update(updates: Params, state: tuple, params: Optional[Params] = None):
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init, update)


def apply_updates(params: Params, updates: Params) -> None:
    """params += updates, in place, one fused op over all tensors."""
    keys = list(updates)
    torch._foreach_add_([params[k] for k in keys], [updates[k] for k in keys])


def _local_norm_sq(tree: Params) -> Tensor:
    tensors = list(tree.values())
    if not tensors:
        return torch.zeros(())
    norms = torch._foreach_norm(tensors)
    return torch.stack(norms).square().sum()


_norm_sq: contextvars.ContextVar[NormSq] = contextvars.ContextVar("fz_norm_sq", default=_local_norm_sq)


@contextlib.contextmanager
def _binding(var: contextvars.ContextVar, fn: Callable) -> Iterator[None]:
    token = var.set(fn)
    try:
        yield
    finally:
        var.reset(token)


def norm_reduction(fn: NormSq):
    """Within this block, `global_norm` uses `fn` (sum of squares over every shard)."""
    return _binding(_norm_sq, fn)


def _identity_sum(tree: Params) -> Params:
    return tree


_shard_sum: contextvars.ContextVar[Callable[[Params], Params]] = contextvars.ContextVar(
    "fz_shard_sum", default=_identity_sum)


def shard_reduction(fn: Callable[[Params], Params]):
    """Within this block, `sum_across_shards` uses `fn` (the step binds it to the group)."""
    return _binding(_shard_sum, fn)


def sum_across_shards(partial: Params) -> Params:
    """{param name: partial sum over this rank's rows} -> the sum over the whole parameter.

    For statistics a sharded optimizer needs whole (LAMB's per-parameter norms,
    Adafactor's column means): one collective for all of them. Parameters whose
    optimizer state is replicated come back unchanged.
    """
    return _shard_sum.get()(partial)


def global_norm(tree: Params) -> Tensor:
    """L2 norm over every element of every leaf, across all ranks' shards."""
    return _norm_sq.get()(tree).sqrt()


def lr_at(lr: "float | Callable[[int], float]", count: int) -> float:
    """A learning rate is a number or a schedule: a function of the step count."""
    return float(lr(count)) if callable(lr) else float(lr)
