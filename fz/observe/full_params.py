"""`full_params`: every parameter whole, and the buffers of the model's state_dict, identical on
every rank (for export and tests: `model.load_state_dict(fz.full_params(state), strict=True)`).

A collective API: every rank of the mesh calls it (stage 3 all-gathers within the shard group).
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import Shard

from fz.distributed import peers
from fz.distributed.arrival import arrive
from fz.errors import ConfigError
from fz.sharding.buckets import Bucket
from fz.sharding.comm import Comm, full_views, unpack
from fz.sharding.pack import checked_flats
from fz.state import State, expect_state
from fz.storage.disk import load


def full_params(state: State, dtype: torch.dtype | str | None = None) -> dict[str, Tensor]:
    """{name: full tensor}: the parameters (sharded buckets all-gathered, one bucket at a time), then
    the persistent buffers (BatchNorm's statistics; not the non-persistent ones, such as a RoPE
    table, which a state_dict leaves out too). The names are those of `model.state_dict()`: a
    tied parameter (an LM head tied to the embedding) appears under each of its names, as the
    same tensor, so `model.load_state_dict(full_params(state), strict=True)` loads.

    `dtype`: None (the default) gives the weights' source of truth, as checkpoints and
    `fz consolidate` hold them: the fp32 master weights in mixed precision (bf16, fp16), else
    the parameters (fp32 runs, frozen parameters, which have no master). "compute" gives the
    copy the forward computes with (bf16 in a bf16 run). A torch.dtype casts the default's
    floating tensors to it (e.g. torch.bfloat16 for a bf16 export of the fp32 masters).
    """
    expect_state(state, "fz.full_params")
    cast, compute = _dtype_arg(dtype)
    plan = state.plan
    peers.doing("fz.full_params", int(state.step))
    arrive("fz.full_params", plan.ranks, plan.rank)  # one rank alone fails fast, not a hang
    flats, sync, mflats = checked_flats(state)
    if sync is not None:
        sync.finish()
    comm = Comm(plan)
    out: dict[str, Tensor] = {}
    for b, flat, mflat in zip(plan.buckets, flats, mflats):
        if mflat is None or compute:
            tensors = _whole(comm, load(flat), b, b.sharded_param)  # a shard on the disk tier: read now
        else:
            tensors = _whole(comm, load(mflat).to(plan.device), b, isinstance(b.place.opt, Shard))
        out.update(zip((s.name for s in b.slots), tensors))
    out.update((n, state.buffers[n].clone()) for n in state.skeleton.persistent if n in state.buffers)
    if cast is not None:
        out = {n: t.to(cast) if t.is_floating_point() else t for n, t in out.items()}
    return _with_aliases(out, state.skeleton.aliases)


def _dtype_arg(dtype: torch.dtype | str | None) -> tuple[torch.dtype | None, bool]:
    """(the dtype to cast to, whether the compute copy is asked for)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype, False
    if dtype == "compute":
        return None, True
    raise ConfigError(f"fz.full_params(dtype={dtype!r}): give None (the fp32 master weights in mixed precision), "
                      "'compute' (the copy the forward uses) or a torch.dtype such as torch.bfloat16")


def _whole(comm: Comm, flat: Tensor, b: Bucket, sharded: bool) -> list[Tensor]:
    """Each parameter of bucket `b` whole, from its storage `flat` (this rank's rows if `sharded`)."""
    if not sharded:
        return [t.clone() for t in full_views(flat, b)]
    if comm.world == 1:
        return [t.clone() for t in unpack(flat, b)]
    full = torch.empty(b.padded_numel, dtype=flat.dtype, device=flat.device)
    comm.all_gather(full, flat)
    return unpack(full, b)


def _with_aliases(out: dict[str, Tensor], aliases: dict[str, str]) -> dict[str, Tensor]:
    """`out` under every name of the model's state_dict, in its order: each tied name is the same
    tensor as its canonical one."""
    named = {n: out[c] for n, c in aliases.items() if c in out}
    named.update((n, t) for n, t in out.items() if n not in named)
    return named
