"""`State`: the whole training state as one immutable value (flax's TrainState).

Leaves (what a checkpoint saves, what `tree_map` sees): `step`, `params`
({name: DTensor}, in the compute dtype), `master` (fp32 master weights as DTensors with the
optimizer's placements, or None in fp32 where the params are the master), `opt_state`
(the optimizer's pytree, param-shaped leaves as DTensors), `scaler` (fp16 loss-scaler
tensors, or None), `rng` (this rank's generator state), `buffers` ({name: tensor},
replicated) and `data` (the data loader's position: any pytree, {} by default).
Static fields: the meta skeleton, the spec and the sharding plan.

At stages 1-2 a state returned by `train_step` may still be receiving its parameters
(`sync`: all-gathers that the next step overlaps with its forward). Like a JAX array
under async dispatch, reading `params` (or the storage under it) waits for them.

`train_step` donates its input state, as `jax.jit(donate_argnums=0)` does: the new
state reuses the buffers, and the old one refuses further use with a clear error.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch.utils._pytree as pytree
from torch import Tensor
from torch.distributed.tensor import DTensor

from fz.errors import ConfigError
from fz.sharding.plan import ShardPlan
from fz.sharding.sync import ParamSync
from fz.model.skeleton import Skeleton
from fz.spec import Spec


class Lease:
    """Whether a state's buffers still belong to it (False once donated to a step)."""

    __slots__ = ("alive",)

    def __init__(self) -> None:
        self.alive = True


@dataclass(frozen=True)
class State:
    step: Tensor
    params: Dict[str, DTensor]
    master: Optional[Dict[str, DTensor]]
    opt_state: Any
    scaler: Optional[Dict[str, Tensor]]
    rng: Tensor
    buffers: Dict[str, Tensor]
    data: Any
    skeleton: Skeleton = field(repr=False, compare=False)
    spec: Spec = field(repr=False, compare=False)
    plan: ShardPlan = field(repr=False, compare=False)
    flats: Tuple[Tensor, ...] = field(repr=False, compare=False)  # per-bucket storage the params view
    master_flats: Tuple[Optional[Tensor], ...] = field(repr=False, compare=False)  # ... and the master weights
    lease: Lease = field(default_factory=Lease, repr=False, compare=False)
    sync: Optional[ParamSync] = field(default=None, repr=False, compare=False)  # parameters still arriving

    def __getattribute__(self, name: str) -> Any:
        if name in _SYNCED:
            sync = object.__getattribute__(self, "sync")
            if sync is not None and sync.pending:
                sync.finish()
        return object.__getattribute__(self, name)

    def raw(self, name: str) -> Any:
        """A field as it is now, without waiting for parameters in flight (train_step's own use)."""
        return object.__getattribute__(self, name)

    def replace(self, **changes: Any) -> "State":
        """A new State with `changes`; the buffers are shared, not copied."""
        return dataclasses.replace(self, lease=Lease(), **changes)

    def check_alive(self, what: str) -> None:
        if not self.lease.alive:
            raise ConfigError(f"{what}: this state was donated to fz.train_step; use the state it returned")

    @property
    def mesh(self):
        return self.plan.mesh

    def __repr__(self) -> str:
        n = sum(p.numel() for p in self.params.values())
        return (f"State(step={int(self.step)}, params={len(self.params)} tensors / {n:,} elements, "
                f"stage={self.spec.stage}, world={self.plan.world})")


_SYNCED = frozenset(("params", "flats"))
_LEAVES = ("step", "params", "master", "opt_state", "scaler", "rng", "buffers", "data")
_STATIC = ("skeleton", "spec", "plan", "flats", "master_flats", "lease", "sync")


def _flatten(s: State):
    return [getattr(s, f) for f in _LEAVES], tuple(getattr(s, f) for f in _STATIC)


def _unflatten(values, context) -> State:
    return State(**dict(zip(_LEAVES, values)), **dict(zip(_STATIC, context)))


pytree.register_pytree_node(State, _flatten, _unflatten, serialized_type_name="fz.State")
