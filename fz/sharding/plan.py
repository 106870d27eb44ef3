"""`ShardPlan`: the frozen map from parameter names to bucket storage on this rank.

Each bucket's storage is one flat tensor per rank: the full parameters (replicated
buckets, param-major) or this rank's padded Shard(0) rows (rank-major: the bucket's
[shards, shard_numel] layout, whose row r is rank r's rows of every parameter). The State
holds that storage as DTensor leaves; a parameter by name is a view of it, so a
collective on the bucket is one call on one tensor.

The plan holds no tensors and nothing mutable, so two states can share it and compare it.
On a 2-D mesh every placement gains a leading Replicate() for the "replicate" dimension.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from fz.sharding.buckets import Bucket, Slot
from fz.sharding.comm import full_views, local_rows_of_full, shard_views


@dataclass(frozen=True)
class ShardPlan:
    mesh: DeviceMesh
    device: torch.device
    buckets: tuple[Bucket, ...]
    rank: int  # this rank's global rank
    ranks: tuple[int, ...]  # global ranks of the whole mesh
    shard_rank: int  # position within the shard group
    shard_ranks: tuple[int, ...]  # global ranks of this rank's shard group
    replicas: int  # shard groups holding replicas of each other (1 on a 1-D mesh)
    shard_group: dist.ProcessGroup | None = field(compare=False, repr=False)
    replica_group: dist.ProcessGroup | None = field(compare=False, repr=False)

    @staticmethod
    def build(mesh: DeviceMesh, device: torch.device, buckets: tuple[Bucket, ...]) -> ShardPlan:
        shard_group = mesh.get_group(mesh.ndim - 1)
        replica_group = mesh.get_group(0) if mesh.ndim == 2 else None
        return ShardPlan(mesh, device, tuple(buckets), dist.get_rank(), tuple(mesh.mesh.flatten().tolist()),
                         mesh.get_local_rank(mesh.ndim - 1), tuple(dist.get_process_group_ranks(shard_group)),
                         mesh.size(0) if mesh.ndim == 2 else 1, shard_group, replica_group)

    @property
    def shards(self) -> int:
        """Ranks each sharded tensor is split over (ZeRO's N)."""
        return len(self.shard_ranks)

    @property
    def world(self) -> int:
        return len(self.ranks)

    def placements(self, p: Placement) -> tuple[Placement, ...]:
        """The stage table's placement as one per mesh dimension."""
        return (p,) if self.mesh.ndim == 1 else (Replicate(), p)

    def slots(self) -> dict[str, tuple[Bucket, Slot]]:
        return {s.name: (b, s) for b in self.buckets for s in b.slots}

    # -- flat storage (the State's leaves) --------------------------------------------------

    def flat_shape(self, b: Bucket, placement: Placement) -> torch.Size:
        return torch.Size((b.padded_numel if isinstance(placement, Shard) else b.full_numel,))

    def wrap_flat(self, local: Tensor, b: Bucket, placement: Placement) -> DTensor:
        """A bucket's storage as a DTensor: Shard(0) of the rank-major padded flat, or Replicate."""
        return self.to_dtensor(local, self.flat_shape(b, placement), placement)

    def to_dtensor(self, local: Tensor, shape: torch.Size, placement: Placement) -> DTensor:
        """Wrap without dispatching an op on `local` (it may still be arriving: see sync.py)."""
        stride = torch.empty(shape, device="meta").stride()
        spec = DTensorSpec(self.mesh, self.placements(placement), TensorMeta(shape, stride, local.dtype))
        return DTensor(local, spec, requires_grad=False)

    # -- per-parameter views of the storage -------------------------------------------------

    def param_locals(self, flat: Tensor, b: Bucket) -> list[Tensor]:
        """The local tensor of each parameter: full (replicated) or its rows (sharded)."""
        return shard_views(flat, b, self.shard_rank) if b.sharded_param else full_views(flat, b)

    def master_locals(self, mflat: Tensor, b: Bucket) -> list[Tensor]:
        """Master weights: full layout (optimizer Replicate) or this rank's padded rows."""
        return shard_views(mflat, b, self.shard_rank) if isinstance(b.place.opt, Shard) else full_views(mflat, b)

    def opt_locals(self, flat: Tensor, mflat: Tensor | None, b: Bucket) -> list[Tensor]:
        """What the optimizer updates for each parameter: the whole of it or this rank's rows
        (of the fp32 master weights in mixed precision, else of the parameters themselves)."""
        if mflat is not None:
            return self.master_locals(mflat, b)
        if b.sharded_param:
            return shard_views(flat, b, self.shard_rank)
        if isinstance(b.place.opt, Shard):
            return local_rows_of_full(flat, b, self.shard_rank)
        return full_views(flat, b)

    def named(self, flats: Sequence[Tensor] | dict[int, Tensor], views_of: Callable[[Tensor, Bucket], list[Tensor]],
              placement_of: Callable[[Bucket], Placement]) -> dict[str, DTensor]:
        """{name: DTensor view} of per-bucket storage (`flats`: bucket index -> local flat)."""
        out: dict[str, DTensor] = {}
        for b in self.buckets:
            flat = flats.get(b.index) if isinstance(flats, dict) else flats[b.index]
            if flat is None:
                continue
            placement = placement_of(b)
            for s, t in zip(b.slots, views_of(flat, b)):
                out[s.name] = self.to_dtensor(t, s.shape, placement)
        return out
