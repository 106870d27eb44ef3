"""Ready-made optimizers, as chains of transforms (optax's aliases)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fz.optim.base import (
    CastGroups,
    GradientTransformation,
    Params,
    cast_groups_into,
    cast_into,
    chain,
    decay_factor_check,
    lr_at,
    owned,
)
from fz.optim.kernel import adamw_
from fz.optim.transforms import LR, AdamState, add_decayed_weights, scale_by_adam, scale_by_learning_rate, trace


def adamw(lr: LR = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 0.01, bias_correction: bool = True) -> GradientTransformation:
    """AdamW with decoupled weight decay, as torch.optim.AdamW.

    The chain is the definition; its `step` runs torch's fused AdamW kernel (one pass over
    each shard instead of a dozen), with the chain's state layout and results; on the host,
    with `cast=`, fz's kernel of the same arithmetic that also writes the bf16 parameters in
    that pass (fz/optim/kernel.py). Both always correct the bias, so `bias_correction=False`
    (DeepSpeed's option) runs the chain.
    """
    t = chain(scale_by_adam(*betas, eps, bias_correction), add_decayed_weights(weight_decay),
              scale_by_learning_rate(lr, weight_decay))
    if not bias_correction:
        return t
    return _FusedAdamW(t.init, t.update, lr, betas, eps, weight_decay)


def takes_host_kernel(tx: GradientTransformation) -> bool:
    """Whether `tx`'s step runs fz's host AdamW kernel where its state and parameters are in host
    memory (`adamw` with bias correction: fz/optim/kernel.py)."""
    return isinstance(tx, _FusedAdamW)


@dataclass(frozen=True, eq=False)
class _FusedAdamW(GradientTransformation):
    """adamw: `update` is the chain's; `step` is the same step in torch's fused kernel (on the host
    with `cast=`, in fz's one-pass kernel of the same arithmetic)."""

    lr: LR
    betas: tuple[float, float]
    eps: float
    weight_decay: float

    def step(self, grads: Params, state: tuple, params: Params, *, donate: bool = False, cast: Params | None = None,
             grad_mul: Tensor | None = None, groups: CastGroups | None = None, **extra: Any) -> tuple:
        """`grad_mul`: the gradients are multiplied by it first (the clip's factor): in the host
        kernel's own pass, else in place before torch's. `groups`: on the host, each group's
        parameters are updated and cast by one kernel call, then closed, before the next
        (elementwise arithmetic: the same values in any grouping)."""
        keys = list(grads)
        tensors = [*(params[k] for k in keys), *(grads[k] for k in keys)]
        if not tensors or any(t.dtype != tensors[0].dtype or t.device != tensors[0].device for t in tensors):
            if grad_mul is not None:
                torch._foreach_mul_(list(grads.values()), grad_mul)
            state = GradientTransformation.step(self, grads, state, params, donate=donate, cast=cast, **extra)
            cast_groups_into(groups, params)
            return state
        adam, decay, lr_state = state
        mu, nu = owned([adam.mu[k] for k in keys], donate), owned([adam.nu[k] for k in keys], donate)
        count = adam.count + 1
        value = lr_at(self.lr, int(lr_state.count))
        decay_factor_check(value, self.weight_decay, int(lr_state.count))
        step = torch.tensor(float(count), device=tensors[0].device)  # fused CUDA kernels take it on the device
        at = {k: i for i, k in enumerate(keys)}

        def on_host(names: list[str], targets: Params) -> None:
            idx = [at[k] for k in names]
            adamw_([params[k] for k in names], [grads[k] for k in names], [mu[j] for j in idx], [nu[j] for j in idx],
                   step, lr=value, beta1=self.betas[0], beta2=self.betas[1], weight_decay=self.weight_decay,
                   eps=self.eps, cast=[targets.get(k) for k in names], grad_mul=grad_mul)

        if step.device.type == "cpu":  # the host: the kernel that also writes the casts in its pass
            done: set[str] = set()
            for i, names in enumerate(groups.groups if groups is not None else []):
                assert groups is not None
                on_host(names, groups.open(i))  # each name a gradient's: a group is cast whole
                groups.close(i)
                done.update(names)
            if rest := [k for k in keys if k not in done]:
                on_host(rest, cast or {})
        else:
            if grad_mul is not None:
                torch._foreach_mul_([grads[k] for k in keys], grad_mul)
            torch._fused_adamw_([params[k] for k in keys], [grads[k] for k in keys], mu, nu, [],
                                [step] * len(keys), lr=value, beta1=self.betas[0], beta2=self.betas[1],
                                weight_decay=self.weight_decay, eps=self.eps, amsgrad=False, maximize=False)
            if cast:
                cast_into(cast, params)
            cast_groups_into(groups, params)
        return (AdamState(count, dict(zip(keys, mu)), dict(zip(keys, nu))), decay,
                type(lr_state)(lr_state.count + 1, torch.tensor(value, dtype=torch.float64)))


def adam(lr: LR = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0, bias_correction: bool = True) -> GradientTransformation:
    """Adam with L2 weight decay added to the gradient, as torch.optim.Adam."""
    return chain(add_decayed_weights(weight_decay), scale_by_adam(*betas, eps, bias_correction),
                 scale_by_learning_rate(lr))


def sgd(lr: LR = 1e-2, momentum: float = 0.0, nesterov: bool = False,
        weight_decay: float = 0.0) -> GradientTransformation:
    """SGD with optional (Nesterov) momentum and L2 weight decay, as torch.optim.SGD."""
    if nesterov and momentum <= 0:
        raise ValueError("nesterov momentum needs momentum > 0")
    parts = [add_decayed_weights(weight_decay)]
    if momentum:
        parts.append(trace(momentum, nesterov))
    parts.append(scale_by_learning_rate(lr, weight_decay))
    return chain(*parts)
