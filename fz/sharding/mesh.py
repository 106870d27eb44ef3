"""The device mesh fz shards over: the default process group, or one made for world size 1."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fz.errors import ConfigError


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
    dev = device_type()
    if not dist.is_initialized():
        backend = "nccl" if dev == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dev == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    return init_device_mesh(dev, (dist.get_world_size(),))
