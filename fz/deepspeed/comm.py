"""`deepspeed.comm` on fz: the process group calls DeepSpeed scripts make (`dist.get_rank()`,
`dist.barrier()`, ...), torch.distributed's own on the group fz joined (its timeout applies)."""
from __future__ import annotations

import os

from torch.distributed import (
    ReduceOp,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    get_rank,
    get_world_size,
    is_initialized,
)

from fz.deepspeed.initialize import init_distributed


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


__all__ = ["ReduceOp", "all_gather", "all_reduce", "barrier", "broadcast", "get_local_rank", "get_rank",
           "get_world_size", "init_distributed", "is_initialized"]
