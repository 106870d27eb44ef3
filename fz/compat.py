"""What differs between the torch releases fz supports (2.11 to 2.15), in one place.

Each shim detects the feature, not the version: call sites import from here and never
compare version strings. Keep every difference here, with the releases it concerns.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn there);
# 2.11 and 2.12 have only the old ones. The name is looked up on `dist` at each call, so a test
# that wraps torch.distributed's functions sees fz's calls.
_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def all_gather_single(out: Tensor, inp: Tensor, **kwargs: Any) -> dist.Work | None:
    """`out` = every rank's `inp` concatenated in rank order (torch's all-gather into one tensor)."""
    return getattr(dist, _ALL_GATHER)(out, inp, **kwargs)


def reduce_scatter_single(out: Tensor, inp: Tensor, **kwargs: Any) -> dist.Work | None:
    """`out` = this rank's 1/world of every rank's `inp`, reduced (torch's reduce-scatter of one tensor)."""
    return getattr(dist, _REDUCE_SCATTER)(out, inp, **kwargs)


class FileSystemWriter(dcp.FileSystemWriter):
    """DCP's file-system writer whose save returns where each chunk's bytes went.

    `dcp.save` returns the global Metadata it passed to the writer's `finish`; torch 2.11's
    `finish` fills `storage_data` on a copy (`dataclasses.replace`), so the returned one has
    none and fz's index (fz/ckpt/index.py) could not say where any chunk is. Fill it here.
    """

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        if metadata.storage_data is None:
            metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}


def checkpoint_generator_name() -> str:
    """The torch.utils.checkpoint global that every `checkpoint(use_reentrant=False)` call runs
    (looked up at each call; fz/step/binding.py wraps it to notice a checkpoint inside a block).

    torch 2.15 moved its body to `_checkpoint_without_reentrant_generator_impl`, leaving the
    old name a shim that `checkpoint()` no longer calls: wrapping the old name there missed
    every checkpoint, and a block's recompute met fz's meta tensors.
    """
    import torch.utils.checkpoint as cp
    new = "_checkpoint_without_reentrant_generator_impl"
    return new if hasattr(cp, new) else "_checkpoint_without_reentrant_generator"
