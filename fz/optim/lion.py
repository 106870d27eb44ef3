"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

update = sign(b1 * m + (1 - b1) * g); m <- b2 * m + (1 - b2) * g;
p <- p - lr * (update + weight_decay * p)   (decoupled decay, as DeepSpeed's FusedLion).
Purely elementwise, so Shard(0) row shards need no communication.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fz.errors import ConfigError
from fz.optim.base import GradientTransformation, Params, chain, owned
from fz.optim.transforms import LR, _chunks, add_decayed_weights, scale_by_learning_rate


class LionState(NamedTuple):
    mu: Params


def scale_by_lion(b1: float = 0.9, b2: float = 0.99) -> GradientTransformation:
    """sign of the interpolated momentum; the momentum then moves with b2."""

    def init(params: Params) -> LionState:
        return LionState({k: torch.zeros_like(p) for k, p in params.items()})

    def update(updates: Params, state: LionState, params: Params | None = None, *, donate: bool = False,
               **extra: Any) -> tuple[Params, LionState]:
        keys = list(updates)
        g = owned([updates[k] for k in keys], donate)
        m = owned([state.mu[k] for k in keys], donate)
        for lo, hi in _chunks(g):  # the result overwrites the gradients; scratch is one chunk
            direction = torch._foreach_lerp(m[lo:hi], g[lo:hi], 1 - b1)
            torch._foreach_lerp_(m[lo:hi], g[lo:hi], 1 - b2)
            torch._foreach_sign_(direction)
            torch._foreach_copy_(g[lo:hi], direction)
            del direction
        return dict(zip(keys, g)), LionState(dict(zip(keys, m)))

    return GradientTransformation(init, update)


def lion(lr: LR = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
         weight_decay: float = 0.0) -> GradientTransformation:
    """Lion with decoupled weight decay; lr is typically 3-10x smaller than AdamW's."""
    b1, b2 = betas
    for name, b in (("betas[0]", b1), ("betas[1]", b2)):
        if not 0.0 <= b <= 1.0:
            raise ConfigError(f"lion {name}={b!r}: must be in [0, 1]")
    return chain(scale_by_lion(b1, b2), add_decayed_weights(weight_decay),
                 scale_by_learning_rate(lr, weight_decay))
