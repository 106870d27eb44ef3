"""Room for an async save's snapshot in the offload directory, checked before it starts.

An async save copies this rank's tensors before training goes on (saver._stage); a tensor of
the disk tier (NVMe offload) is copied into a new file of its offload directory, so a full
disk there would otherwise end in a raw OSError halfway through the copy, on every rank.
"""
from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from torch import Tensor
from torch.distributed.tensor import DTensor

from fz.errors import CheckpointError
from fz.storage.disk import DiskTensor

_FULL = (errno.ENOSPC, errno.EDQUOT)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def snapshot_bytes(tensors: Iterable[Tensor]) -> dict[str, int]:
    """{offload directory: bytes} that staging `tensors` writes there (their disk-tier parts)."""
    need: dict[str, int] = {}
    for t in tensors:
        local = t._local_tensor if isinstance(t, DTensor) else t
        if isinstance(local, DiskTensor):
            d = local._blob.store.dir
            need[d] = need.get(d, 0) + local.nbytes_on_disk
    return need


def _error(where: Path, directory: str, need: int, free: int | None) -> CheckpointError:
    have = f"has {_gib(free)} free" if free is not None else "is full"
    return CheckpointError(
        f"async save of checkpoint {where}: the offload directory {directory} {have}; the snapshot of this rank's "
        f"offloaded state needs {_gib(need)} there (an async save copies it before training goes on). Free space "
        f"there, give fz.offload.nvme a larger disk, or save with async_=False (it reads the offloaded state in place)")


def check(where: Path, tensors: Iterable[Tensor]) -> None:
    """A CheckpointError naming the directory and the space needed, unless each offload
    directory has room for its share of the snapshot."""
    for directory, need in snapshot_bytes(tensors).items():
        free = shutil.disk_usage(directory).free
        if need > free:
            raise _error(where, directory, need, free)


def staged(where: Path, tensors: dict[str, Tensor], stage: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
    """`stage` applied to each tensor after `check`; a disk that fills meanwhile (another process
    writes there) is the same CheckpointError, not the raw OSError."""
    check(where, tensors.values())
    try:
        return {k: stage(t) for k, t in tensors.items()}
    except OSError as e:
        if e.errno not in _FULL:
            raise
        need = snapshot_bytes(tensors.values())
        directory = next((d for d in need if d in str(e)), next(iter(need), os.fspath(where)))
        raise _error(where, directory, need.get(directory, 0), None) from e
