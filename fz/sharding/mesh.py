"""The device mesh fz shards over: the default process group, or one made for world size 1."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fz.errors import ConfigError


_IMPLICIT = False  # True once fz started its own one-process group


def user_world_size():
    """The world size torch.distributed was started with by the user; None if it was not
    (fz's own one-process group does not count)."""
    if not dist.is_available() or not dist.is_initialized() or _IMPLICIT:
        return None
    return dist.get_world_size()


def device_type() -> str:
    """CUDA with NCCL where there is a GPU, else the CPU with gloo."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_mesh(mesh: Optional[DeviceMesh] = None) -> DeviceMesh:
    """`mesh` itself, else a 1-D mesh over the default process group.

    Without torch.distributed initialised, fz starts a one-process group of its own
    (world size 1), so the same code runs in a notebook and under torchrun.
    """
    if mesh is not None:
        if mesh.ndim != 1:
            raise ConfigError(f"fz shards over a 1-D mesh, got a {mesh.ndim}-D one")
        return mesh
    global _IMPLICIT
    dev = device_type()
    if not dist.is_initialized():
        backend = "nccl" if dev == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        _IMPLICIT = True
    if dev == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    return init_device_mesh(dev, (dist.get_world_size(),))
