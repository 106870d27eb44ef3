"""Checking a State's storage leaves, and packing tensors given by name into new storage.

Whatever a user put into a leaf (by `replace`, `tree_map` or `fz.restore`) is what the next
step uses, so it must fit exactly: a DTensor on the state's mesh with the bucket's
placements, shape and dtype. A leaf that does not fit is a ConfigError naming it; nothing
is converted behind the user's back.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from fz.errors import ConfigError
from fz.sharding.buckets import Bucket
from fz.sharding.sync import ParamSync, local_data


def bucket_label(b: Bucket) -> str:
    more = f" and {len(b.slots) - 1} more" if len(b.slots) > 1 else ""
    return f"the bucket of {b.slots[0].name!r}{more}"


def _check(plan, what: str, t, shape: torch.Size, placement, dtype: torch.dtype) -> Tensor:
    """The local tensor of `t` if it is a DTensor with these shape, placements and dtype."""
    want = plan.placements(placement)
    if not isinstance(t, DTensor):
        raise ConfigError(f"{what} is a {type(t).__name__}; expected a DTensor on the state's mesh with placements "
                          f"{want}, shape {tuple(shape)} and dtype {dtype}")
    if tuple(t.placements) != want or t.device_mesh != plan.mesh:
        raise ConfigError(f"{what} has placements {tuple(t.placements)} on mesh {t.device_mesh}; this state needs "
                          f"{want} on {plan.mesh}")
    if t.shape != shape:
        raise ConfigError(f"{what} has shape {tuple(t.shape)}; expected {tuple(shape)}")
    if t.dtype != dtype:
        raise ConfigError(f"{what} is {t.dtype}; expected {dtype} (fz never converts a leaf silently)")
    return t._local_tensor


def checked_flats(state) -> tuple[list[Tensor], ParamSync | None, list[Tensor | None]]:
    """(param storage per bucket, the sync still bringing some of it, master storage per bucket)."""
    plan, spec = state.plan, state.spec
    if len(state.param_flats) != len(plan.buckets):
        raise ConfigError(f"state.param_flats has {len(state.param_flats)} buckets; the plan has {len(plan.buckets)}")
    flats, sync = [], None
    for b, t in zip(plan.buckets, state.param_flats):
        local = _check(plan, f"state.param_flats[{b.index}] ({bucket_label(b)})", t,
                       plan.flat_shape(b, b.place.param), b.place.param, spec.compute_dtype)
        data, pending = local_data(local)
        sync = sync or pending
        flats.append(data if data.is_contiguous() else data.contiguous())
    masters: list[Tensor | None] = [None] * len(plan.buckets)
    want = {b.index for b in plan.buckets if b.trainable} if spec.precision != "fp32" else set()
    if set(state.master_flats) != want:
        raise ConfigError(
            f"state.master_flats holds buckets {sorted(state.master_flats)}; this spec needs {sorted(want)}"
        )
    for i, t in state.master_flats.items():
        b = plan.buckets[i]
        local = _check(plan, f"state.master_flats[{i}] ({bucket_label(b)})", t, plan.flat_shape(b, b.place.opt),
                       b.place.opt, torch.float32)
        masters[i] = local if local.is_contiguous() else local.contiguous()
    return flats, sync, masters


def _pack(state, named: dict[str, Tensor] | None, field: str, placement_of, views_of, dtype,
          buckets) -> dict[int, DTensor]:
    plan = state.plan
    if not isinstance(named, dict):
        raise ConfigError(f"State.replace({field}=...) takes {{name: DTensor}}, got {type(named).__name__}")
    names = {s.name for b in buckets for s in b.slots}
    extra = sorted(set(named) - names)
    if extra:
        raise ConfigError(f"State.replace({field}=...): {extra[0]!r} is not one of this state's {field}")
    out: dict[int, DTensor] = {}
    for b in buckets:
        placement = placement_of(b)
        flat = torch.zeros(plan.flat_shape(b, placement)[0] // (plan.shards if placement.is_shard() else 1),
                           dtype=dtype, device=plan.device)
        for s, view in zip(b.slots, views_of(flat, b)):
            if s.name not in named:
                raise ConfigError(f"State.replace({field}=...) is missing {s.name!r}")
            view.copy_(_check(plan, f"{field}[{s.name!r}]", named[s.name], s.shape, placement, dtype))
        out[b.index] = plan.wrap_flat(flat, b, placement)
    return out


def pack_params(state, named: dict[str, Tensor]) -> tuple[DTensor, ...]:
    plan = state.plan
    packed = _pack(state, named, "params", lambda b: b.place.param, plan.param_locals, state.spec.compute_dtype,
                   plan.buckets)
    return tuple(packed[b.index] for b in plan.buckets)


def masters_following(state, named: dict[str, Tensor]) -> dict[str, Tensor]:
    """A mixed-precision state's masters after `replace(params=named)` (checked by pack_params): where
    `named` changes a parameter's compute-dtype value, the master takes it, widened; elsewhere it keeps
    its fp32 bits (an edit of some weights leaves the others' masters exact). Local: a parameter's
    placement is its master's or Replicate, read as this rank's rows."""
    old = state.params
    out: dict[str, Tensor] = {}
    for name, m in state.master.items():
        mesh, place, given = m.device_mesh, m.placements, named[name]
        assert isinstance(given, DTensor)  # pack_params refuses anything else
        new = given.redistribute(mesh, place).to_local()
        before = old[name].redistribute(mesh, place).to_local()
        here = m.to_local()  # compared where the master is (host memory, when offloaded)
        kept = torch.where(new.to(here.device) == before.to(here.device), here, new.to(here.device, torch.float32))
        out[name] = DTensor.from_local(kept, mesh, place, run_check=False, shape=m.shape, stride=m.stride())
    return out


def pack_master(state, named: dict[str, Tensor] | None) -> dict[int, DTensor]:
    if state.spec.precision == "fp32":
        if named:
            raise ConfigError("State.replace(master=...): an fp32 state has no master weights (its params are "
                              "the master); replace params instead")
        return {}
    plan = state.plan
    return _pack(state, named, "master", lambda b: b.place.opt, plan.master_locals, torch.float32,
                 [b for b in plan.buckets if b.trainable])
