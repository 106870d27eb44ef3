"""Adafactor with torch.optim.Adafactor's algorithm and defaults, on Shard(0) row shards.

Per parameter, at step t: beta2_t = 1 - t**beta2_decay, rho = min(lr, 1/sqrt(t)),
alpha = max(eps2, RMS(p)) * rho. Parameters with >= 2 dims keep factored second moments
over their last two dims (a running mean of g^2 over each row and over each column);
the estimate is row (x) col / mean(row). Others keep a full running mean of g^2. The
update g / sqrt(v) is divided by max(1, RMS(update) / d) and scaled by alpha; weight
decay multiplies p by (1 - lr * weight_decay).

transformers' Adafactor with scale_parameter=False, relative_step=False (what the Trainer's
optim="adafactor" builds) is the same algorithm with alpha = lr: `capped_lr=False` (rho = lr)
and `scale_by_rms=False` (no RMS(p) factor).

Sharding: a rank holds rows [r*chunk, ...) of each parameter. RMS(p), RMS(update), the
element count, and for 2-D parameters the column sums of g^2 (a column runs over ALL
rows) and the mean of the row statistic go through `sum_across_shards`: two collectives
per step for all parameters together. The column statistic is replicated on every rank.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fz.errors import ConfigError
from fz.optim.base import GradientTransformation, Params, check_settings, lr_at, owned, sum_across_shards
from fz.optim.transforms import LR


class AdafactorState(NamedTuple):
    # 0-d int64: updates applied
    count: Tensor  # type: ignore[assignment]  # optax's name (checkpoints use it) shadows tuple.count
    lr: Tensor  # 0-d float64: the lr of the last update
    v_rows: Params  # >= 2-D params: mean of g^2 over the last dim, shape p.shape[:-1] (this rank's rows)
    v_cols: Params  # >= 2-D params: mean of g^2 over dim -2, shape p.shape[:-2] + (cols,) (whole, replicated)
    v: Params  # other params: running mean of g^2, like p


def _factored(p: Tensor) -> bool:
    return p.dim() >= 2


def _rows_across_shards(p: Tensor) -> bool:
    """Whether dim -2 (a column) is the sharded dim 0, so column sums need every rank."""
    return p.dim() == 2


def adafactor(lr: LR = 1e-2, beta2_decay: float = -0.8, eps: tuple[float | None, float] = (None, 1e-3),
              d: float = 1.0, weight_decay: float = 0.0, *, capped_lr: bool = True,
              scale_by_rms: bool = True, eps1_added: bool = False) -> GradientTransformation:
    """torch.optim.Adafactor (foreach=False, maximize=False), sharding-aware; eps1 None = dtype eps.

    capped_lr=False, scale_by_rms=False: the step size is lr itself (transformers' Adafactor with
    scale_parameter=False, relative_step=False). eps1_added: eps1 is added to g^2 before the
    running means (transformers' way, with its eps1 1e-30) instead of flooring the estimate."""
    eps1_arg, eps2 = eps
    if not beta2_decay <= 0:
        raise ConfigError(f"adafactor beta2_decay={beta2_decay!r}: must be <= 0")
    if (eps1_arg is not None and not 0 < eps1_arg < math.inf) or not 0 <= eps2 < math.inf:
        raise ConfigError(f"adafactor eps={eps!r}: eps1 must be > 0 or None (the dtype's eps: 0 divides 0 by 0 where "
                          "a parameter has no gradient yet, NaN in the weights), eps2 a finite number >= 0")
    if not 1 <= d < math.inf:
        raise ConfigError(f"adafactor d={d!r}: must be a finite number >= 1")
    check_settings("adafactor", weight_decay=weight_decay)

    def init(params: Params) -> AdafactorState:
        row, col, var = {}, {}, {}
        for k, p in params.items():
            if _factored(p):
                row[k] = p.new_zeros(p.shape[:-1])
                col[k] = p.new_zeros(p.shape[:-2] + p.shape[-1:])
            else:
                var[k] = torch.zeros_like(p)
        return AdafactorState(torch.zeros((), dtype=torch.int64), torch.tensor(lr_at(lr, 0), dtype=torch.float64),
                              row, col, var)

    def update(updates: Params, state: AdafactorState, params: Params | None = None, *, donate: bool = False,
               shard_sum: Callable[[Params], Params] | None = None, **extra: Any) -> tuple[Params, AdafactorState]:
        if params is None:
            raise ConfigError("adafactor needs params (its step size is relative to RMS(p))")
        mine = lambda tree: dict(zip(tree, owned(list(tree.values()), donate)))  # noqa: E731
        updates, v_rows, v_cols, v_full = mine(updates), mine(state.v_rows), mine(state.v_cols), mine(state.v)
        lr_t = lr_at(lr, int(state.count))
        t = float(state.count + 1)
        beta2_t = t ** beta2_decay
        rho = min(lr_t, 1 / math.sqrt(t)) if capped_lr else lr_t

        keep = 1.0 - beta2_t  # transformers' beta2t: its running means as it writes them (rounding included)

        def squared(g: Tensor) -> Tensor:
            sq = g.square()
            return sq.add_(eps1_arg or 0.0) if eps1_added else sq

        def mix(v: Tensor, x: Tensor) -> None:
            if eps1_added:
                v.mul_(keep).add_(x, alpha=1.0 - keep)
            else:
                v.lerp_(x, beta2_t)

        # Round 1: per parameter [sum p^2, local rows, (2-D: column sums of g^2, sum of row stat)].
        stats: dict[str, Tensor] = {}
        for k, g in updates.items():
            p = params[k]
            parts = [p.float().square().sum().reshape(1), p.new_full((1,), float(p.shape[0] if p.dim() else 1))]
            if _factored(p):
                g2 = squared(g)
                mix(v_rows[k], g2.mean(dim=-1))
                if _rows_across_shards(p):
                    parts += [g2.sum(dim=0), v_rows[k].sum().reshape(1)]
                del g2
            stats[k] = torch.cat([x.float() for x in parts])
        stats = sum_across_shards(stats, shard_sum)

        out: dict[str, Tensor] = {}
        numel: dict[str, int] = {}
        alpha: dict[str, float] = {}
        for k, g in updates.items():
            p, s = params[k], stats[k]
            eps1 = 0.0 if eps1_added else torch.finfo(p.dtype).eps if eps1_arg is None else eps1_arg
            numel[k] = int(round(float(s[1]))) * (math.prod(p.shape[1:]) if p.dim() else 1)
            rms = math.sqrt(float(s[0])) / math.sqrt(max(numel[k], 1))
            alpha[k] = max(eps2, rms) * rho if scale_by_rms else rho
            if _factored(p):
                if _rows_across_shards(p):
                    rows = float(s[1])
                    col_mean = s[2:-1].to(g.dtype) / rows
                    row_mean = s[-1] / rows
                else:
                    col_mean = squared(g).mean(dim=-2)
                    row_mean = v_rows[k].mean(dim=-1)
                mix(v_cols[k], col_mean)
                denom = torch.as_tensor(row_mean, dtype=g.dtype).clamp(min=eps1)
                denom = denom.unsqueeze(-1) if denom.dim() else denom
                if eps1_added:  # transformers' _approx_sq_grad: rsqrt(row / mean(row)) x rsqrt(col)
                    factor = (v_rows[k] / denom).rsqrt_().unsqueeze(-1) * v_cols[k].unsqueeze(-2).rsqrt()
                    out[k] = g.mul_(factor)  # in place: scratch is one parameter
                    continue
                v = v_rows[k].unsqueeze(-1) * v_cols[k].unsqueeze(-2)
                v.div_(denom.unsqueeze(-1))
            else:
                mix(v_full[k], squared(g))
                v = v_full[k].clone()
            out[k] = g.mul_((v if eps1_added else v.clamp_(min=eps1 * eps1)).rsqrt_())  # in place: one parameter
            del v

        # Round 2: sum of update^2, for the update's RMS clipping.
        sq = sum_across_shards({k: u.float().square().sum().reshape(1) for k, u in out.items()}, shard_sum)
        for k, u in out.items():
            clip = max(1.0, math.sqrt(float(sq[k])) / (math.sqrt(max(numel[k], 1)) * d))
            u.mul_(-alpha[k] / clip)
            if weight_decay:
                u.add_(params[k], alpha=-lr_t * weight_decay)
        return out, AdafactorState(state.count + 1, torch.tensor(lr_t, dtype=torch.float64), v_rows, v_cols, v_full)

    return GradientTransformation(init, update)
