"""Parameters that get no gradient in a step (an unused MoE expert, a branch not taken).

fz reduces gradients in flat buckets, so by default such a parameter is updated as if its
gradient were zero (DeepSpeed's behaviour: weight decay and momentum still move it).
`Spec(skip_unused=True)` skips it as a plain torch loop does (its gradient is None there):
the step watches which parameters backward reaches on each rank, one small all-reduce
finds those no rank used, and their values and optimizer moments are put back after the
update. (A shared step count, such as Adam's bias correction, still advances.)
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from fz.sharding.comm import Comm


class UsedParams:
    """Which parameters backward reached on this rank (a hook on each tensor a block is given)."""

    def __init__(self) -> None:
        self.used: set[str] = set()

    def watch(self, tensors: dict[str, Tensor]) -> None:
        for name, t in tensors.items():
            if t.requires_grad:
                t.register_hook(partial(self._reached, name))

    def _reached(self, name: str, grad: Tensor | None) -> None:
        # stage 3's tensors are outputs of one gather (an autograd Function per bucket): backward
        # calls the hook of an output it did not reach with None, not a gradient
        if grad is not None:
            self.used.add(name)


def unused_everywhere(comm: Comm, names: Sequence[str], used: set[str]) -> set[str]:
    """The names no rank used (one all-reduce of a flag per parameter, in `names`' order)."""
    flags = torch.tensor([float(n in used) for n in names], device=comm.device)
    if comm.world > 1:
        comm.all_reduce_sum(flags, scalar=True)
    comm.replica_sum(flags, scalar=True)
    return {n for n, f in zip(names, flags.tolist()) if f == 0}


def _owner(path: Sequence[Any]) -> Any:
    return next((e.key for e in path if isinstance(e, pytree.MappingKey)), None)


def snapshot(skip: set[str], params: dict[str, Tensor], opt_state: Any) -> tuple[dict[str, Tensor], list]:
    """Copies of the skipped parameters' local values and optimizer-state leaves."""
    kept = {n: params[n].clone() for n in skip if n in params}
    leaves, _ = pytree.tree_flatten_with_path(opt_state)
    moments = [(path, x.clone()) for path, x in leaves if isinstance(x, Tensor) and _owner(path) in skip]
    return kept, moments


def put_back(kept: dict[str, Tensor], moments: list, params: dict[str, Tensor], opt_state: Any) -> None:
    """The skipped parameters and moments as they were before the update (in place)."""
    for n, v in kept.items():
        params[n].copy_(v)
    now = dict(pytree.tree_flatten_with_path(opt_state)[0])
    for path, v in moments:
        now[path].copy_(v)
