"""Where the optimizer runs, chosen once from the Spec: one table, one signature.

    device  the optimizer state lives with the parameters: update in place (fz/step/update.py)
    host    the state is in host memory: the update runs there (fz/step/host_update.py)
    disk    the state (and at stage 3 maybe the parameters) is in files: streamed group by group

Every updater takes the step's `UpdateInputs` and returns an `Updated`: the optimizer's new
local state, the global gradient norm (None without clipping), and the parameter and master
storage the new state holds. `cast` names the buckets whose parameters already hold the
update: the disk tier casts each group as it writes it, and where parameters and fp32 masters
share a layout in host memory the update writes the parameters in its own pass (`host_casts`;
fz/optim/kernel.py); on a GPU, buckets whose parameters are on the device get theirs in that
pass too, into pinned staging copied up bucket by bucket as the update goes (fz/offload/landing.py:
`ready` holds a gathered bucket's rows); the others are cast or gathered from the masters after it.
`Spec.skip_unused` (device and host only: the disk tier streams group by group and the Spec
refuses it there) restores the parameters no rank used, as torch skips them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from fz.offload.landing import landing_for
from fz.offload.transfer import pool_for
from fz.optim.base import cast_into
from fz.sharding.comm import Comm
from fz.sharding.plan import ShardPlan
from fz.sharding.sync import gathered
from fz.spec import Spec
from fz.step.host_update import host_update
from fz.step.stream import disk_update
from fz.step.unused import put_back, snapshot
from fz.step.update import GradNorms, apply_optimizer

Params = dict[str, Tensor]


@dataclass
class UpdateInputs:
    """What the step hands its updater (all owned by the step: updaters may update them in place)."""

    local_opt: Any  # this rank's optimizer state
    grads: Params  # fp32, unscaled, this rank's rows
    params: Params  # the tensors the optimizer updates (masters in mixed precision)
    flats: list[Tensor]  # parameter storage per bucket
    mflats: list[Tensor | None]  # master storage per bucket (None: fp32 without masters)
    sharded: set[str]  # parameters whose optimizer state is sharded over the ranks
    skip: set[str]  # Spec.skip_unused: parameters no rank used this step
    donate: bool
    norms: GradNorms | None = None  # the gradients' norms, taken for the non-finite check (clipping on)
    after: Callable[[], None] | None = None  # disk tier: once the update is done (it may stream on: stream.py)


@dataclass
class Updated:
    local_opt: Any
    norm: Tensor | None
    flats: list[Tensor]
    mflats: list[Tensor | None]
    cast: frozenset[int]  # buckets whose parameters already hold the update (nothing to cast from the masters)
    # gathered buckets whose updated rows the update already cast (and copied up), in the parameters'
    # dtype where they live: the all-gather's input (fz/offload/landing.py)
    ready: dict[int, Tensor] = field(default_factory=dict)


Updater = Callable[[Spec, Comm, ShardPlan, UpdateInputs], Updated]


def host_casts(plan: ShardPlan, flats: list[Tensor], mflats: list[Tensor | None]) -> tuple[Params, frozenset[int]]:
    """({name: its parameter's local view}, the buckets they cover): where parameters and fp32
    masters share a layout in host memory, the update writes the parameters as it goes (one pass
    over the masters, not a second one to cast them after); gathered buckets and device memory
    keep their own way (an all-gather, a copy to the device)."""
    cast: Params = {}
    done = set()
    for b, flat, mflat in zip(plan.buckets, flats, mflats):
        if (b.trainable and mflat is not None and not gathered(plan, b) and flat.device.type == "cpu"
                and mflat.device.type == "cpu"):
            cast.update(zip((s.name for s in b.slots), plan.master_locals(flat, b)))
            done.add(b.index)
    return cast, frozenset(done)


def _in_memory(run: Callable[..., tuple[Any, Tensor | None]]) -> Updater:
    """Device and host: the optimizer over `params` in place, the skipped parameters put back."""
    def update(spec: Spec, comm: Comm, plan: ShardPlan, x: UpdateInputs) -> Updated:
        cast, done = host_casts(plan, x.flats, x.mflats)
        # the other buckets with host masters land bucket by bucket as they are updated; not where
        # skipped parameters are put back after the update (they would have left already)
        pool = pool_for(spec.offload) if spec.offload is not None else None
        landing = None if x.skip else landing_for(plan, x.flats, x.mflats, done, pool)
        kept = snapshot(x.skip, x.params, x.local_opt) if x.skip else None
        try:
            local_opt, norm = run(spec, comm, x.local_opt, x.grads, x.params, x.sharded, x.norms, cast,
                                  landing.groups if landing is not None else None)
        finally:
            if landing is not None:
                landing.finish()
        if kept is not None:
            put_back(*kept, x.params, local_opt)
            cast_into({n: cast[n] for n in kept[0] if n in cast}, x.params)  # their parameters as they were
        if landing is None:
            return Updated(local_opt, norm, x.flats, x.mflats, cast=done)
        return Updated(local_opt, norm, x.flats, x.mflats, cast=done | landing.cast, ready=landing.ready)
    return update


def _on_disk(spec: Spec, comm: Comm, plan: ShardPlan, x: UpdateInputs) -> Updated:
    local_opt, norm, mflats, flats = disk_update(spec, spec.offload, comm, plan, x.local_opt, x.grads, x.flats,
                                                 x.mflats, x.sharded, x.donate, x.norms, x.after)
    return Updated(local_opt, norm, flats, mflats, cast=frozenset(range(len(flats))))


UPDATERS: dict[str, Updater] = {
    "device": _in_memory(apply_optimizer),
    "host": _in_memory(host_update),
    "disk": _on_disk,
}


def update_tier(spec: Spec) -> str:
    """Where this Spec's optimizer update runs: a key of UPDATERS."""
    policy = spec.offload if spec.offload is not None and spec.offload.active else None
    if policy is None:
        return "device"
    if "disk" in (policy.optimizer, policy.params):
        return "disk"
    return "host" if policy.optimizer == "host" else "device"
