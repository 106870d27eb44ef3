"""Starting torch.distributed: from torchrun's environment, or one process of fz's own.

    fz.distributed.init()      # what fz.init does when no process group is running

Under torchrun (`WORLD_SIZE` and friends in the environment) the default group is
initialised from that environment, so every process joins the one job, within a deadline
(fz/distributed/startup.py); a `WORLD_SIZE`
without the rest is an error naming what is missing, never a silent one-process run.
Without `WORLD_SIZE` (a notebook, `python script.py`) fz starts a one-process group.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from fz.distributed import startup
from fz.errors import ConfigError

ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_own = None  # the one-process group fz started, if it did


def device_type() -> str:
    """CUDA with NCCL where there is a GPU, else the CPU with gloo."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def implicit() -> bool:
    """Whether the running group is fz's own one-process group (not one the user started)."""
    return dist.is_initialized() and _own is not None and dist.group.WORLD is _own


def _env_world() -> int | None:
    raw = os.environ.get("WORLD_SIZE")
    if raw is None:
        return None
    try:
        world = int(raw)
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={raw!r} in the environment is not an integer") from None
    if world < 1:
        raise ConfigError(f"WORLD_SIZE={world} in the environment must be >= 1")
    missing = [k for k in ENV if not os.environ.get(k)]
    if missing:
        raise ConfigError(f"WORLD_SIZE={world} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                          "not: start the processes with torchrun (it sets all of "
                          f"{', '.join(ENV)}), set them yourself, or unset WORLD_SIZE to run one process")
    return world


def init(backend: str | None = None, timeout: timedelta | None = None) -> tuple[int, int]:
    """Start the default process group unless one is running; return (rank, world size).

    With `WORLD_SIZE` in the environment (torchrun sets it, with RANK, MASTER_ADDR and
    MASTER_PORT) the group is initialised from the environment, every step of it within
    `timeout` (else the last Spec.timeout_s): a rank that does not come, dies or freezes is
    an fz.PeerError naming it; without it, fz starts a one-process group. `backend` defaults
    to nccl with CUDA, else gloo. On CUDA the current device becomes `LOCAL_RANK` (else rank
    modulo the device count).
    """
    global _own
    dev = device_type()
    if not dist.is_initialized():
        backend = backend or ("nccl" if dev == "cuda" else "gloo")
        world = _env_world()
        if world is not None:  # within `timeout` at every step, a missing rank named (fz/distributed/startup.py)
            startup.start(backend, world, timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
            _own = dist.group.WORLD
    if dev == "cuda":
        local = os.environ.get("LOCAL_RANK")
        index, count = int(local) if local is not None else dist.get_rank(), torch.cuda.device_count()
        if index >= count and dist.get_backend() == "nccl":
            raise ConfigError(f"LOCAL_RANK={index} but this machine has {count} GPU(s): NCCL cannot put two ranks on "
                              "one GPU. Start at most one process per GPU (torchrun --nproc-per-node), or use "
                              "backend='gloo' to share one")
        torch.cuda.set_device(index % count)  # gloo: several ranks may share a GPU
    return dist.get_rank(), dist.get_world_size()
