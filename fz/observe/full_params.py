"""`full_params`: every parameter whole, and the buffers of the model's state_dict, identical on
every rank (for export and tests: `model.load_state_dict(fz.full_params(state), strict=True)`).

A collective API: every rank of the mesh calls it (stage 3 all-gathers within the shard group).
"""
from __future__ import annotations

import torch
from torch import Tensor

from fz.distributed import peers
from fz.distributed.arrival import arrive
from fz.sharding.comm import Comm, full_views, unpack
from fz.sharding.pack import checked_flats
from fz.state import State, expect_state
from fz.storage.disk import load


def full_params(state: State) -> dict[str, Tensor]:
    """{name: full tensor}: the parameters (sharded buckets all-gathered, one bucket at a time), then
    the persistent buffers (BatchNorm's statistics; not the non-persistent ones, such as a RoPE
    table, which a state_dict leaves out too)."""
    expect_state(state, "fz.full_params")
    plan = state.plan
    peers.doing("fz.full_params", int(state.step))
    arrive("fz.full_params", plan.ranks, plan.rank)  # one rank alone fails fast, not a hang
    flats, sync, _ = checked_flats(state)
    if sync is not None:
        sync.finish()
    comm = Comm(plan)
    out: dict[str, Tensor] = {}
    for b, flat in zip(plan.buckets, flats):
        flat = load(flat)  # a shard on the disk tier: read now
        if not b.sharded_param:
            tensors = [t.clone() for t in full_views(flat, b)]
        elif comm.world == 1:
            tensors = [t.clone() for t in unpack(flat, b)]
        else:
            full = torch.empty(b.padded_numel, dtype=flat.dtype, device=flat.device)
            comm.all_gather(full, flat)
            tensors = unpack(full, b)
        out.update(zip((s.name for s in b.slots), tensors))
    out.update((n, state.buffers[n].clone()) for n in state.skeleton.persistent if n in state.buffers)
    return out
