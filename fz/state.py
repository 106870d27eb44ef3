"""`State`: the whole training state as one immutable value (flax's TrainState).

Leaves (what `tree_map` sees, what the next step uses, exactly as they are):
- `param_flats`: per bucket, the parameters' storage in the compute dtype, a DTensor
  (Replicate, or Shard(0) of the bucket's rank-major padded layout; fz/sharding/plan.py);
- `master_flats`: {bucket index: fp32 master weights' storage}, in mixed precision only;
- `opt_state` (the optimizer's pytree, param-shaped leaves as DTensors), `scaler` (fp16
  loss-scaler tensors, or None), `step`, `rng` (this rank's generator state), `buffers`,
  `data` (the data loader's position) and `metrics` (what the last step measured: call
  order, bytes, grad norm, lr, loss scale; fz/observe reads them).
Static: the meta skeleton, the spec and the frozen sharding plan (no tensors, nothing mutable).

`params` and `master` by name are DTensor views of the storage, made on demand.
At stages 1-2 a state returned by `train_step` may hold parameters still arriving
(fz/sharding/sync.py): leaf-level futures, never waited for by flattening or printing.

`train_step` donates its input state, as `jax.jit(donate_argnums=0)` does: the new state
reuses the buffers, and the old one refuses further use with a clear error.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch.utils._pytree as pytree
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fz.errors import ConfigError
from fz.model.skeleton import Skeleton
from fz.sharding.plan import ShardPlan
from fz.spec import Spec

MAX_STEPS = 2**48  # the most updates a run counts: a step or count read from a file past it is refused (its +1s
# would near int64's wrap to -2**63, where Adam's bias correction and a schedule's lr turn NaN or negative)


@dataclass(frozen=True, eq=False)
class State:
    step: Tensor
    param_flats: tuple[DTensor, ...]
    master_flats: dict[int, DTensor]
    opt_state: Any
    scaler: dict[str, Tensor] | None
    rng: Tensor
    buffers: dict[str, Tensor]
    data: Any
    metrics: dict[str, Any]
    skeleton: Skeleton = field(repr=False)
    spec: Spec = field(repr=False)
    plan: ShardPlan = field(repr=False)

    @cached_property
    def params(self) -> dict[str, DTensor]:
        """{name: DTensor} views of `param_flats` (no copy, no wait)."""
        self.check_alive("state.params")
        plan = self.plan
        return plan.named([f._local_tensor for f in self.param_flats], plan.param_locals, lambda b: b.place.param)

    @cached_property
    def master(self) -> dict[str, DTensor] | None:
        """{name: fp32 master weights} views of `master_flats`; None in fp32 (the params are the master)."""
        self.check_alive("state.master")
        if self.spec.precision == "fp32":
            return None
        plan = self.plan
        return plan.named({i: f._local_tensor for i, f in self.master_flats.items()}, plan.master_locals,
                          lambda b: b.place.opt)

    @property
    def mesh(self) -> DeviceMesh:
        return self.plan.mesh

    def replace(self, **changes: Any) -> State:
        """A new State with `changes`; leaves not named are shared, not copied.

        `params=` / `master=` take {name: tensor} (e.g. a tree_map of `state.params`): they
        are packed into new bucket storage after checking each tensor's shape, dtype and
        placement (fz.ConfigError naming the first that does not fit). In mixed precision,
        `params=` without `master=` changes the fp32 masters too (the optimizer updates them, and
        the next step's params are made from them): each value `params=` changes, widened; the
        others keep their master's bits.
        """
        from fz.sharding.pack import masters_following, pack_master, pack_params
        packed = "params" in changes or "master" in changes  # into device memory, whatever the tier
        if "params" in changes:
            named = changes.pop("params")
            changes["param_flats"] = pack_params(self, named)
            if "master" not in changes and self.master_flats:
                changes["master"] = masters_following(self, named)
        if "master" in changes:
            changes["master_flats"] = pack_master(self, changes.pop("master"))
        new = dataclasses.replace(self, **changes)
        # packed in device memory: back to the tiers the offload policy keeps them in (host, disk)
        policy = new.spec.offload
        return policy(new) if packed and policy is not None and policy.active else new

    @property
    def donated_to(self) -> str | None:
        """What this state was given up to (fz.train_step, a load that filled it in place), or None: live."""
        return self.__dict__.get("_donated")

    def check_alive(self, what: str) -> None:
        if to := self.donated_to:
            raise ConfigError(f"{what}: this state was donated to {to}; use the state it returned"
                              + (" (`state, loss = fz.train_step(state, batch)`; donate=False keeps this one, at the "
                                 "cost of a copy)" if to == "fz.train_step" else " (where it raised, there is none: "
                                 "make a new state with fz.init; a load that failed may have filled this one in part)"))

    def donate(self, to: str = "fz.train_step") -> None:
        """Mark this state as given up to a step or a load (`to`: its buffers now belong to the new state);
        its storage leaves are dropped, so files of the disk tier go as soon as the new state replaces them."""
        object.__setattr__(self, "_donated", to)
        for name in ("param_flats", "master_flats", "opt_state"):
            object.__setattr__(self, name, None)
        self.__dict__.pop("params", None)
        self.__dict__.pop("master", None)

    def __repr__(self) -> str:
        if self.donated_to:
            return f"State(donated to {self.donated_to})"
        n = sum(s.numel for b in self.plan.buckets for s in b.slots)
        mesh = "x".join(str(d) for d in self.plan.mesh.shape)
        return (f"State(step={int(self.step)}, params={sum(len(b.slots) for b in self.plan.buckets)} tensors / "
                f"{n:,} elements, stage={self.spec.stage}, mesh={mesh})")

    def __reduce__(self) -> Any:
        """Not picklable (its leaves are shards over a process group; its optimizer is functions): said so."""
        raise TypeError("an fz.State cannot be pickled (its tensors are this rank's shards over the process group, "
                        "its optimizer is functions): fz.save / fz.restore write and read it (atomic, on every rank), "
                        "fz.full_params(state) gives the weights as plain tensors")

    def __copy__(self) -> State:
        self.check_alive("copy.copy")
        return dataclasses.replace(self)  # the leaves shared, as `replace` shares those it is not given

    def __deepcopy__(self, memo: dict[int, Any]) -> State:
        """Every tensor copied (parameters still arriving are waited for: their copy is whole)."""
        self.check_alive("copy.deepcopy")
        return pytree.tree_map(lambda x: x.clone() if isinstance(x, Tensor) else _copy_leaf(x, memo), self)


def expect_state(x: Any, what: str) -> State:
    """`x` if it is a live fz.State; otherwise the error says what `what` takes and what it got."""
    if isinstance(x, State):
        x.check_alive(what)
        return x
    import torch.nn as nn
    kind = f"{type(x).__module__}.{type(x).__qualname__}".removeprefix("builtins.")
    if isinstance(x, nn.Module):
        got = f"a model ({kind}): make the state once with `state = fz.init(model, spec)` and pass that"
    elif isinstance(x, Spec):
        got = "an fz.Spec: make the state once with `state = fz.init(model, spec)` and pass that"
    elif isinstance(x, tuple) and x and isinstance(x[0], State):
        got = "a tuple: fz.train_step returns (state, loss); write `state, loss = fz.train_step(state, batch)`"
    elif x is None:
        got = "None (was the state assigned from a function that returns nothing?)"
    else:
        got = f"a {kind}"
    raise ConfigError(f"{what} takes an fz.State (made by `fz.init(model, spec)`) as its state; it got {got}")


def block_until_ready(state: State) -> State:
    """`state` with every parameter still arriving waited for (as `jax.block_until_ready`), and
    every offload file an update still streams into written: the returned state's leaves are
    plain storage. Waits only for work already started (collectives, the update's thread)."""
    expect_state(state, "fz.block_until_ready")
    from fz.sharding.sync import Arriving
    from fz.storage.disk import DiskTensor
    for leaf in pytree.tree_leaves((state.param_flats, state.master_flats, state.opt_state)):
        local = getattr(leaf, "_local_tensor", leaf)
        if isinstance(local, DiskTensor):
            local._blob.ready()
    leaves = []
    for f in state.param_flats:
        local = f._local_tensor
        leaves.append(state.plan.to_dtensor(local.result(), f.shape, f.placements[-1])
                      if isinstance(local, Arriving) else f)
    return dataclasses.replace(state, param_flats=tuple(leaves))


def _copy_leaf(x: Any, memo: dict[int, Any]) -> Any:
    return copy.deepcopy(x, memo)


_LEAVES = ("step", "param_flats", "master_flats", "opt_state", "scaler", "rng", "buffers", "data", "metrics")


class _Static:
    """A state's static part: compared by value, so states from one init (or equal ones) share a treedef."""

    __slots__ = ("skeleton", "spec", "plan")

    def __init__(self, skeleton: Skeleton, spec: Spec, plan: ShardPlan):
        self.skeleton, self.spec, self.plan = skeleton, spec, plan

    def __eq__(self, other: Any) -> bool:
        return (isinstance(other, _Static) and self.spec == other.spec and self.plan == other.plan
                and self.skeleton.signature == other.skeleton.signature)

    def __hash__(self) -> int:
        return hash((self.plan.buckets, self.skeleton.signature))

    def __repr__(self) -> str:
        return f"fz.State static(stage={self.spec.stage}, buckets={len(self.plan.buckets)})"


def _flatten(s: State) -> tuple[list[Any], _Static]:
    s.check_alive("flattening a State")
    return [getattr(s, f) for f in _LEAVES], _Static(s.skeleton, s.spec, s.plan)


def _unflatten(values: Iterable[Any], context: _Static) -> State:
    return State(**dict(zip(_LEAVES, values)), skeleton=context.skeleton, spec=context.spec, plan=context.plan)


def _flatten_with_keys(s: State) -> tuple[list[tuple[pytree.KeyEntry, Any]], _Static]:
    leaves, context = _flatten(s)
    return [(pytree.GetAttrKey(k), v) for k, v in zip(_LEAVES, leaves)], context


pytree.register_pytree_node(State, _flatten, _unflatten, serialized_type_name="fz.State",
                            flatten_with_keys_fn=_flatten_with_keys)
