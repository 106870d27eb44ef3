"""LAMB (You et al. 2019), with DeepSpeed FusedLamb's semantics, on Shard(0) row shards.

Per parameter: Adam moments m, v with bias correction (m_hat = m / (1 - b1^t), likewise v),
u = m_hat / (sqrt(v_hat) + eps) + weight_decay * p, then p <- p - lr * trust * u with
trust = ||p|| / ||u|| clamped to [min_coeff, max_coeff] (FusedLamb: [0.01, 10]); trust is
1 when either norm is 0. `eps_inside_sqrt=True` uses sqrt(v_hat + eps) instead.
min_coeff=0, max_coeff=inf gives the paper's / optax's unclamped ratio.

The norms are whole-parameter statistics: both squared sums go through one
`sum_across_shards` call per step for all parameters.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fz.errors import ConfigError
from fz.optim.base import GradientTransformation, Params, chain, check_settings, owned, sum_across_shards
from fz.optim.transforms import LR, _chunks, scale_by_learning_rate


class LambState(NamedTuple):
    # 0-d int64: updates applied
    count: Tensor  # type: ignore[assignment]  # optax's name (checkpoints use it) shadows tuple.count
    mu: Params
    nu: Params


def scale_by_lamb(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                  max_coeff: float = 10.0, min_coeff: float = 0.01, eps_inside_sqrt: bool = False,
                  bias_correction: bool = True) -> GradientTransformation:
    """The trust-ratio-scaled Adam direction (multiply by -lr afterwards)."""

    def init(params: Params) -> LambState:
        zeros = lambda: {k: torch.zeros_like(p) for k, p in params.items()}  # noqa: E731
        return LambState(torch.zeros((), dtype=torch.int64), zeros(), zeros())

    def update(updates: Params, state: LambState, params: Params | None = None, *, donate: bool = False,
               shard_sum: Callable[[Params], Params] | None = None, **extra: Any) -> tuple[Params, LambState]:
        if params is None:
            raise ConfigError("lamb needs params (the trust ratio uses ||p||)")
        count = state.count + 1
        t = int(count)
        keys = list(updates)
        g, m, v, p = ([tree[k] for k in keys] for tree in (updates, state.mu, state.nu, params))
        g, m, v = owned(g, donate), owned(m, donate), owned(v, donate)
        torch._foreach_lerp_(m, g, 1 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, g, g, value=1 - b2)
        bc1, bc2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1.0, 1.0)
        for lo, hi in _chunks(g):  # the direction overwrites the gradients; scratch is one chunk
            if eps_inside_sqrt:
                denom = torch._foreach_div(v[lo:hi], bc2)
                torch._foreach_add_(denom, eps)
                torch._foreach_sqrt_(denom)
            else:
                denom = torch._foreach_sqrt(v[lo:hi])
                torch._foreach_div_(denom, math.sqrt(bc2))
                torch._foreach_add_(denom, eps)
            torch._foreach_copy_(g[lo:hi], m[lo:hi])
            torch._foreach_div_(g[lo:hi], denom)
            del denom
        u = g
        torch._foreach_div_(u, bc1)
        if weight_decay:
            torch._foreach_add_(u, p, alpha=weight_decay)

        sums = {k: torch.stack([pk.float().square().sum(), uk.float().square().sum()])
                for k, pk, uk in zip(keys, p, u)}
        sums = sum_across_shards(sums, shard_sum)
        for k, uk in zip(keys, u):
            w_norm, u_norm = (float(x) for x in sums[k].sqrt())
            trust = 1.0
            if w_norm != 0 and u_norm != 0:
                trust = min(max(w_norm / u_norm, min_coeff), max_coeff)
            uk.mul_(trust)
        return dict(zip(keys, u)), LambState(count, dict(zip(keys, m)), dict(zip(keys, v)))

    return GradientTransformation(init, update)


def lamb(lr: LR = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
         max_coeff: float = 10.0, min_coeff: float = 0.01, eps_inside_sqrt: bool = False,
         bias_correction: bool = True) -> GradientTransformation:
    """LAMB with DeepSpeed FusedLamb's defaults and trust-ratio clamping."""
    if not 0 <= min_coeff <= max_coeff:
        raise ConfigError(f"lamb min_coeff={min_coeff!r}, max_coeff={max_coeff!r}: need 0 <= min_coeff <= max_coeff")
    check_settings("lamb", betas=betas, eps=eps, weight_decay=weight_decay)
    return chain(scale_by_lamb(betas[0], betas[1], eps, weight_decay, max_coeff, min_coeff, eps_inside_sqrt,
                               bias_correction),
                 scale_by_learning_rate(lr))
