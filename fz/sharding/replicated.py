"""Replicated values are the same on every rank: checked once, at fz.init, by a checksum.

A replicated tensor that differs between ranks (a buffer a normally built model set
differently per rank, an initialiser that draws from an unseeded source) would make each
rank train a different model without a word. One all-gather of one int64 per tensor (and
on a 2-D mesh a second one of those tables across the replica groups, so every rank of
the mesh sees every rank's sums and all of them raise together) finds it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from fz.compat import all_gather_single
from fz.errors import ConfigError
from fz.sharding.plan import ShardPlan
from fz.sharding.settle import Handle

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(t: Tensor) -> Tensor:
    """The sum of `t`'s bit patterns as int64 (wrapping): equal values, equal sums."""
    flat = t.detach().contiguous().view(-1)
    ints = _INTS.get(flat.element_size())
    bits = flat.view(ints) if ints is not None else flat.view(torch.uint8)
    return bits.sum(dtype=torch.int64)


def _gather(local: Tensor, group: dist.ProcessGroup | None, n: int) -> Tensor:
    out = torch.empty(n * local.numel(), dtype=local.dtype, device=local.device)
    flat = local.reshape(-1)
    Handle([out, flat]).add(all_gather_single(out, flat, group=group, async_op=True)).wait()
    return out.view(n, *local.shape)


_DIFFER = ("replicated tensor(s) differ between ranks, so each rank would train a different model",
           "Initialise them the same way on every rank (seed what draws random numbers, or build the model on "
           "the meta device and let fz initialise it).")


def check_replicated(plan: ShardPlan, named: dict[str, Tensor], what: tuple[str, str] = _DIFFER) -> None:
    """Raise a ConfigError naming each of `named` ({label: tensor}, replicated over the whole
    mesh) whose values differ between ranks, and the ranks that differ from the first.
    `what` is (what differs, how to fix it) for the message."""
    if not named or len(plan.ranks) == 1:
        return
    labels = list(named)
    local = torch.stack([checksum(named[k]) for k in labels]).to(plan.device)
    table = _gather(local, plan.shard_group, plan.shards) if plan.shards > 1 else local[None]
    if plan.replicas > 1:
        table = _gather(table, plan.replica_group, plan.replicas).view(-1, len(labels))
    table = table.cpu()
    ranks = list(plan.ranks)  # mesh order: replica group major, then shard position
    bad: list[str] = []
    for i, label in enumerate(labels):
        differ = [ranks[r] for r in range(len(ranks)) if table[r, i] != table[0, i]]
        if differ:
            bad.append(f"{label}: rank(s) {differ} differ from rank {ranks[0]}")
    if bad:
        shown = "\n  ".join(bad[:10]) + (f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else "")
        raise ConfigError(f"fz.init: {len(bad)} {what[0]}:\n  {shown}\n{what[1]}")
