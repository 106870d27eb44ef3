"""`full_params`: every parameter whole, and the buffers of the model's state_dict, identical on
every rank (for export and tests: `model.load_state_dict(fz.full_params(state), strict=True)`).

A collective API: every rank of the mesh calls it (stage 3 all-gathers within the shard group).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

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
    out = dict(iter_full_params(state, dtype))
    return _with_aliases(out, state.skeleton.aliases)


def iter_full_params(state: State, dtype: torch.dtype | str | None = None) -> Iterator[tuple[str, Tensor]]:
    """`full_params` one tensor at a time, gathering one bucket at a time: peak memory is one
    bucket whole, not the model. Canonical names only (a tied alias is not repeated), in bucket
    order, then the persistent buffers. Each tensor is new (it shares no storage with the state).
    A collective: every rank iterates to the end, in step."""
    cast, compute = _dtype_arg(dtype)
    for name, t in gathered(state, compute, "fz.full_params", copy=True):
        yield name, t.to(cast) if cast is not None and t.is_floating_point() else t


def copy_full_params(state: State, module: torch.nn.Module) -> set[int]:
    """The State's weights copied into `module`'s own tensors of the same state_dict names (each in
    its dtype), one bucket gathered at a time; the ids of the tensors written. A collective."""
    return _copy_into(module, iter_full_params(state))


def _copy_into(module: torch.nn.Module, values: Iterable[tuple[str, Tensor]]) -> set[int]:
    """Each (state_dict name, value) copied into `module`'s tensor of that name, in its dtype; the
    ids of the tensors written."""
    own = module.state_dict(keep_vars=True)
    done: set[int] = set()
    with torch.no_grad():
        for name, value in values:
            if name in own:
                own[name].data.copy_(value.to(own[name].dtype))
                done.add(id(own[name]))
    return done


def _whole_local_flats(state: State, settle: bool = True) -> list[Tensor] | None:
    """This rank's parameter storage per bucket where every rank holds every parameter whole (no
    bucket's parameters sharded: ZeRO 0-2), its sync in flight finished with `settle` (this rank's
    own, not a new collective); None where parameters are sharded."""
    expect_state(state, "fz.full_params")
    if any(b.sharded_param for b in state.plan.buckets):
        return None
    flats, sync, _ = checked_flats(state)
    if sync is not None and settle:
        sync.finish()
    return flats


def copy_local_params(state: State, module: torch.nn.Module) -> set[int] | None:
    """`copy_full_params` without a collective where every rank holds every parameter whole (no
    bucket's parameters sharded: ZeRO 0-2): the copy the forward computes with (a bf16 run's bf16
    values, as DeepSpeed's module holds them at those stages). None where parameters are sharded."""
    flats = _whole_local_flats(state)
    if flats is None:
        return None

    def local() -> Iterator[tuple[str, Tensor]]:
        for b, flat in zip(state.plan.buckets, flats):
            yield from zip((s.name for s in b.slots), full_views(load(flat), b))
        yield from ((n, state.buffers[n]) for n in state.skeleton.persistent if n in state.buffers)

    return _copy_into(module, local())


def local_param_views(state: State, settle: bool = True) -> dict[str, Tensor] | None:
    """Each parameter, by canonical name, as a view of this rank's own storage of it in the State
    (the copy the forward computes with: a bf16 run's bf16 values), where every rank holds every
    parameter whole in memory (ZeRO 0-2, none on the disk tier); None elsewhere. Local: no
    collective (this rank's parameter sync still in flight is finished; with `settle=False` it is
    left to finish when the next forward needs it, and the views read its values after that). A step
    updates that storage in place, so a module holding these views as its parameters, as
    DeepSpeed's module holds its own at those stages, reads every later update's values at no cost
    in memory."""
    flats = _whole_local_flats(state, settle)
    if flats is None or any(load(f) is not f for f in flats):  # on the disk tier: a view would be of a copy read now
        return None
    return {s.name: v for b, flat in zip(state.plan.buckets, flats) for s, v in zip(b.slots, full_views(flat, b))}


def source_dtype(state: State, b: Bucket, compute: bool) -> torch.dtype:
    """The dtype `gathered` yields bucket `b`'s tensors in (before any cast)."""
    return state.spec.compute_dtype if compute or b.index not in state.master_flats else torch.float32


def gathered(state: State, compute: bool, api: str, *, copy: bool = False,
             agree: Callable[[BaseException | None], None] | None = None) -> Iterator[tuple[str, Tensor]]:
    """(canonical name, full tensor) of every parameter, one bucket gathered at a time, then the
    persistent buffers. Without `copy`, a tensor may be a view of the state's own storage (an
    unsharded bucket, a buffer): read it, never write it, and drop it before the next one to keep
    memory at one bucket; with `copy` every tensor is new (it shares no storage with the state).

    `compute`: the parameters as the forward uses them; else the fp32 masters where there are.
    `agree(err)` runs on every rank before each bucket's collective with this rank's error in
    reading its part (a disk-tier shard), or None; it must raise on every rank if any rank
    failed, so that no rank is left alone in the gather (default: raise this rank's error)."""
    expect_state(state, api)
    plan = state.plan
    peers.doing(api, int(state.step))
    arrive(api, plan.ranks, plan.rank)  # one rank alone fails fast, not a hang
    flats, sync, mflats = checked_flats(state)
    if sync is not None:
        sync.finish()
    comm = Comm(plan)
    for b, flat, mflat in zip(plan.buckets, flats, mflats):
        err: BaseException | None = None
        local, sharded = flat, False
        try:
            if mflat is None or compute:
                local, sharded = load(flat), b.sharded_param  # a shard on the disk tier: read now
            else:
                local, sharded = load(mflat).to(plan.device), isinstance(b.place.opt, Shard)
        except Exception as e:  # noqa: BLE001 - shared through `agree`, then raised on every rank
            err = e
        if agree is not None:
            agree(err)
        elif err is not None:
            raise err
        yield from zip((s.name for s in b.slots), _whole(comm, local, b, sharded, copy))
    for n in state.skeleton.persistent:
        if n in state.buffers:
            yield n, state.buffers[n].clone() if copy else state.buffers[n]
def _dtype_arg(dtype: torch.dtype | str | None) -> tuple[torch.dtype | None, bool]:
    """(the dtype to cast to, whether the compute copy is asked for)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype, False
    if dtype == "compute":
        return None, True
    raise ConfigError(f"fz.full_params(dtype={dtype!r}): give None (the fp32 master weights in mixed precision), "
                      "'compute' (the copy the forward uses) or a torch.dtype such as torch.bfloat16")


def _whole(comm: Comm, flat: Tensor, b: Bucket, sharded: bool, copy: bool) -> list[Tensor]:
    """Each parameter of bucket `b` whole, from its storage `flat` (this rank's rows if `sharded`);
    views of `flat` unless `copy` (a gathered bucket is new storage either way)."""
    if not sharded or comm.world == 1:
        views = full_views(flat, b) if not sharded else unpack(flat, b)
        return [t.clone() for t in views] if copy else views
    full = torch.empty(b.padded_numel, dtype=flat.dtype, device=flat.device)
    comm.all_gather(full, flat)
    return unpack(full, b)


def _with_aliases(out: dict[str, Tensor], aliases: dict[str, str]) -> dict[str, Tensor]:
    """`out` under every name of the model's state_dict, in its order: each tied name is the same
    tensor as its canonical one."""
    named = {n: out[c] for n, c in aliases.items() if c in out}
    named.update((n, t) for n, t in out.items() if n not in named)
    return named
