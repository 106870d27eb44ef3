"""`ShardPlan`: the static map from parameter names to bucket storage on this rank.

Each bucket owns one flat storage tensor per rank: the full parameters (replicated
buckets) or this rank's padded Shard(0) rows (sharded buckets). Parameters in the state
are DTensors whose local tensors are views of that storage, so a collective on the
bucket is one call on one tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from fz.sharding.comm import Comm, full_views, local_rows_of_full, shard_views
from fz.sharding.gather import LiveCounter
from fz.sharding.buckets import Bucket, Slot


@dataclass(frozen=True)
class ShardPlan:
    mesh: DeviceMesh
    comm: Comm
    device: torch.device
    buckets: Tuple[Bucket, ...]
    live: LiveCounter
    order: List[int] = field(default_factory=list)  # units in forward call order (learned by the first step)
    last_step_bytes: Dict[str, int] = field(default_factory=dict)  # collective kind -> payload bytes

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world(self) -> int:
        return self.comm.world

    def slots(self) -> Dict[str, Tuple[Bucket, Slot]]:
        return {s.name: (b, s) for b in self.buckets for s in b.slots}

    def param_locals(self, flat: Tensor, b: Bucket) -> List[Tensor]:
        """The state's local tensor of each parameter: full (replicated) or its rows (sharded)."""
        return shard_views(flat, b, self.rank) if b.sharded_param else full_views(flat, b)

    def master_locals(self, mflat: Tensor, b: Bucket) -> List[Tensor]:
        """Master weights: full layout (optimizer Replicate) or this rank's padded rows."""
        return shard_views(mflat, b, self.rank) if isinstance(b.place.opt, Shard) else full_views(mflat, b)

    def opt_locals(self, flat: Tensor, mflat: Optional[Tensor], b: Bucket) -> List[Tensor]:
        """What the optimizer updates for each parameter: the whole of it or this rank's rows
        (of the fp32 master weights in mixed precision, else of the parameters themselves)."""
        if mflat is not None:
            return self.master_locals(mflat, b)
        if b.sharded_param:
            return shard_views(flat, b, self.rank)
        if isinstance(b.place.opt, Shard):
            return local_rows_of_full(flat, b, self.rank)
        return full_views(flat, b)

    def to_dtensor(self, local: Tensor, slot: Slot, placement) -> DTensor:
        if isinstance(placement, Shard):
            stride = torch.empty(slot.shape, device="meta").stride()
            return DTensor.from_local(local, self.mesh, [placement], run_check=False, shape=slot.shape, stride=stride)
        return DTensor.from_local(local, self.mesh, [placement], run_check=False)

    def wrap_params(self, flats: Sequence[Tensor]) -> Dict[str, DTensor]:
        out: Dict[str, DTensor] = {}
        for b, flat in zip(self.buckets, flats):
            for s, t in zip(b.slots, self.param_locals(flat, b)):
                out[s.name] = self.to_dtensor(t, s, b.place.param)
        return out

    def wrap_master(self, mflats: Sequence[Optional[Tensor]]) -> Dict[str, DTensor]:
        out: Dict[str, DTensor] = {}
        for b, mflat in zip(self.buckets, mflats):
            if mflat is not None:
                for s, t in zip(b.slots, self.master_locals(mflat, b)):
                    out[s.name] = self.to_dtensor(t, s, b.place.opt)
        return out

    def packed_master(self, master: Optional[Dict[str, DTensor]], mflats: Sequence[Optional[Tensor]]):
        """`mflats` (the same object) if every master weight still views its storage, else fresh copies."""
        if master is None:
            return mflats
        out, changed = _repack(self.buckets, master, mflats, self.master_locals)
        return out if changed else mflats

    def packed_flats(self, params: Dict[str, DTensor], flats: Sequence[Tensor]) -> Tuple[Tuple[Tensor, ...], bool]:
        """(`flats`, False) if every parameter still views its bucket storage, else (fresh copies, True)."""
        return _repack(self.buckets, params, flats, self.param_locals)


def _repack(buckets, tensors: Dict[str, DTensor], storages: Sequence[Optional[Tensor]], views_of):
    """Keep each bucket's storage whose views the tensors still are; copy the others into new storage.

    A user may `replace` or `tree_map` a State: its tensors then no longer view the buckets."""
    out, changed = [], False
    for b, storage in zip(buckets, storages):
        if storage is None:
            out.append(None)
            continue
        locals_ = [_local(tensors[s.name]) for s in b.slots]
        if all(x.data_ptr() == v.data_ptr() and x.shape == v.shape for x, v in zip(locals_, views_of(storage, b))):
            out.append(storage)
            continue
        changed = True
        new = torch.zeros_like(storage)
        for x, v in zip(locals_, views_of(new, b)):
            v.copy_(x)
        out.append(new)
    return tuple(out), changed


def _local(t) -> Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t
