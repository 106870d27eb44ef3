"""Buffers that training changes (BatchNorm's running statistics) stay identical on every rank.

Each rank's forward updates its buffers from its own rows, so they would drift apart while
docs/model.md calls them replicated (and a checkpoint would keep one rank's). After each step
the buffers whose in-place version counter moved, and the running statistics of norm layers
(which the kernel updates without moving it), are made equal again: averaged over every
rank by default (floating ones; others take the first rank's), or the first rank's for all
(`Spec(buffer_sync="rank0")`, DDP's broadcast_buffers). One collective per dtype. With
`Spec(buffer_sync="local")` each rank keeps its own, as DeepSpeed's engine does.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fz.sharding.comm import Comm


def versions(buffers: dict[str, Tensor]) -> dict[str, int]:
    return {n: t._version for n, t in buffers.items()}


def sync_changed(comm: Comm, buffers: dict[str, Tensor], before: dict[str, int], how: str,
                 running: Sequence[str] = ()) -> list[str]:
    """Make the buffers changed since `before` (and the `running` ones) equal on every rank; returns
    their names (sorted, so every rank packs them alike)."""
    changed = sorted(n for n, t in buffers.items() if t._version != before.get(n) or n in running)
    if not changed or how == "local" or (comm.world == 1 and comm.replicas == 1):
        return changed
    by_kind: dict[tuple, list[str]] = {}
    for n in changed:
        t = buffers[n]
        mean = how == "mean" and t.is_floating_point()
        by_kind.setdefault((mean, t.dtype), []).append(n)
    for (mean, _), names in sorted(by_kind.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        flat = torch.cat([buffers[n].reshape(-1) for n in names])
        if mean:
            comm.all_reduce(flat)
            comm.replica_mean(flat)
        else:
            comm.broadcast_first(flat)
        with torch.no_grad():
            for n, part in zip(names, flat.split([buffers[n].numel() for n in names])):
                buffers[n].copy_(part.view_as(buffers[n]))
    return changed
