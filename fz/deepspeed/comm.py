"""`deepspeed.comm` on fz: the process group calls DeepSpeed scripts make (`dist.get_rank()`,
`dist.barrier()`, ...), torch.distributed's own on the group fz joined (its timeout applies).
`barrier` is fz's: bounded by the group's own timeout, a lost peer a PeerError, and seen by the other
ranks as a wait (a rank that calls fz's collectives alone meanwhile, `engine.save_checkpoint()`
under `if rank == 0:`, fails in seconds instead of waiting out the timeout)."""
from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist
from torch.distributed import (
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    broadcast,
    get_rank,
    get_world_size,
    is_available,
    is_initialized,
    new_group,
    reduce,
    reduce_scatter_tensor,
)

from fz.deepspeed.initialize import init_distributed
from fz.distributed import peers
from fz.errors import ConfigError


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> None:
    """torch's barrier on the group, waited for within the group's own timeout (as DeepSpeed's: a rank
    may prepare data for long meanwhile) and marked as a wait; a lost peer is a PeerError."""
    if async_op:
        raise ConfigError("deepspeed.comm.barrier(async_op=True): fz's barrier waits (bounded, a lost peer named); "
                          "call it without async_op")
    peers.doing("deepspeed.comm.barrier")
    peers.wait_work(dist.barrier(group=group, async_op=True, device_ids=device_ids), group_timeout=True)


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def get_world_rank_from_launcher() -> int:
    """The rank the launcher gave this process (RANK), before any process group."""
    return int(os.environ.get("RANK", 0))


def get_world_size_from_launcher() -> int:
    """The world size the launcher set (WORLD_SIZE), before any process group."""
    return int(os.environ.get("WORLD_SIZE", 1))


def log_summary(*args: object, **kwargs: object) -> None:
    """DeepSpeed's communication-log summary: fz keeps no such log (its byte counts: fz.comm_report)."""
    logging.getLogger(__name__).info("deepspeed.comm.log_summary: fz keeps no comms log; fz.comm_report(state) "
                                     "gives the step's bytes")


__all__ = ["ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce", "barrier", "broadcast",
           "get_local_rank", "get_rank", "get_world_rank_from_launcher", "get_world_size",
           "get_world_size_from_launcher", "init_distributed", "is_available", "is_initialized", "log_summary",
           "new_group", "reduce", "reduce_scatter_tensor"]
