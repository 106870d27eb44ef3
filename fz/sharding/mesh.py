"""The device mesh fz shards over: 1-D ("shard",) or 2-D ("replicate", "shard").

A 2-D mesh is hybrid sharding (DeepSpeed's MiCS / ZeRO++ hpZ, FSDP2's HSDP): ZeRO shards
within each group of consecutive ranks along "shard" (a node's fast links) and the groups
hold replicas of each other along "replicate", so only one all-reduce of gradient shards
crosses groups per step.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fz.distributed import group as distributed
from fz.distributed import peers, startup
from fz.errors import ConfigError

MESH_DIMS = ("replicate", "shard")


def user_world_size() -> int | None:
    """The world size torch.distributed was started with by the user; None if it was not
    (fz's own one-process group does not count)."""
    if not dist.is_available() or not dist.is_initialized() or distributed.implicit():
        return None
    return dist.get_world_size()


def make_mesh(mesh: DeviceMesh | None = None, shard_group_size: int | None = None,
              timeout: timedelta | None = None) -> DeviceMesh:
    """`mesh` itself (checked), else a mesh over the default process group: 1-D, or 2-D
    ("replicate", "shard") with groups of `shard_group_size` consecutive ranks. `timeout`
    bounds starting the default group (when fz starts it; it is gloo's timeout then) and the
    mesh's groups, at every rank: a rank lost there is an fz.PeerError naming it."""
    if mesh is not None:
        return _checked(mesh, shard_group_size)
    dev = distributed.device_type()
    rank, world = distributed.init(timeout=timeout)  # torchrun's environment, else a one-process group
    shape: tuple[int, ...] = (world,)
    names: tuple[str, ...] = ("shard",)
    if shard_group_size is not None and shard_group_size != world:
        if world % shard_group_size:
            raise ConfigError(f"Spec.shard_group_size={shard_group_size} does not divide the world size {world}")
        shape, names = (world // shard_group_size, shard_group_size), MESH_DIMS
    if world == 1:
        return init_device_mesh(dev, shape, mesh_dim_names=names)
    limit = peers.timeout_s() if timeout is None else timeout.total_seconds()
    peers.configure(limit)  # the heartbeat runs before the mesh's groups start: a rank lost there is named
    return startup.watched("creating the mesh's process groups", lambda: init_device_mesh(
        dev, shape, mesh_dim_names=names), range(world), rank, limit)


def _checked(mesh: DeviceMesh, shard_group_size: int | None) -> DeviceMesh:
    if mesh.ndim not in (1, 2):
        raise ConfigError(f"fz shards over a 1-D or 2-D mesh, got a {mesh.ndim}-D one")
    if mesh.ndim == 2 and mesh.mesh_dim_names not in (None, MESH_DIMS):
        raise ConfigError(f"a 2-D mesh needs dims {MESH_DIMS} (replicate across groups, shard within), "
                          f"got {mesh.mesh_dim_names}")
    shards = mesh.size(mesh.ndim - 1)
    if shard_group_size is not None and shard_group_size != shards:
        raise ConfigError(f"Spec.shard_group_size={shard_group_size} but the mesh's shard dimension has {shards} "
                          "ranks; leave one of them unset")
    return mesh
