"""The ZeRO stages as a table of DTensor placements, and the flat buckets built from it.

This file is where each stage's behaviour is decided; everything else follows from
the three placements a parameter gets:

| stage | param     | grad      | optimizer state |
|-------|-----------|-----------|-----------------|
| 0     | Replicate | Replicate | Replicate       |
| 1     | Replicate | Replicate | Shard(0)        |
| 2     | Replicate | Shard(0)  | Shard(0)        |
| 3     | Shard(0)  | Shard(0)  | Shard(0)        |

What follows from them:
- param Shard(0): gathered just in time per bucket (all-gather), freed after use.
- grad Replicate: gradients accumulate in full over micro-batches, reduced once per step;
  grad Shard(0): reduce-scattered after every micro-batch, only the shard is kept.
- optimizer Replicate: all-reduce, every rank updates the whole parameter;
  optimizer Shard(0): reduce-scatter, each rank updates its rows, and a replicated
  parameter is all-gathered back after the update.
Per-parameter override: at stage 3 a parameter under `persist_threshold` elements (or a
0-d one) keeps stage 2's placements (DeepSpeed's stage3_param_persistence_threshold).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Sequence, Tuple

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

R, S = Replicate(), Shard(0)


@dataclass(frozen=True)
class Placements:
    param: Placement
    grad: Placement
    opt: Placement


STAGES: Dict[int, Placements] = {
    0: Placements(R, R, R),
    1: Placements(R, R, S),
    2: Placements(R, S, S),
    3: Placements(S, S, S),
}


def placements_for(stage: int, shape: torch.Size, persist_threshold: int) -> Placements:
    """The table's row for one parameter, after the per-parameter override."""
    if stage == 3 and (len(shape) == 0 or math.prod(shape) < persist_threshold):
        return STAGES[2]
    if len(shape) == 0:
        return STAGES[0]  # a scalar cannot be split along dim 0
    return STAGES[stage]


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives inside its bucket's flat buffers.

    Full layout (replicated params): the parameter at `full_offset`, `numel` elements.
    Shard layout (per rank): `chunk` rows of `row_numel`, zero-padded, at `shard_offset`;
    rank r holds rows [r*chunk, min((r+1)*chunk, rows)), as DTensor's Shard(0) does.
    """

    name: str
    shape: torch.Size
    full_offset: int
    shard_offset: int
    chunk: int

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def rows(self) -> int:
        return self.shape[0] if len(self.shape) else 1

    @cached_property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if len(self.shape) else 1

    def local_rows(self, rank: int) -> Tuple[int, int]:
        start = min(rank * self.chunk, self.rows)
        return start, min(start + self.chunk, self.rows)

    def local_shape(self, rank: int) -> torch.Size:
        start, stop = self.local_rows(rank)
        return torch.Size((stop - start, *self.shape[1:]))


@dataclass(frozen=True)
class Bucket:
    """Parameters reduced or gathered by one collective: same unit, placements, trainability."""

    index: int
    unit: int  # index into the skeleton's units; 0 is the root
    place: Placements
    trainable: bool
    slots: Tuple[Slot, ...]
    world: int

    @property
    def sharded_param(self) -> bool:
        return isinstance(self.place.param, Shard)

    @cached_property
    def full_numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @cached_property
    def shard_numel(self) -> int:
        """Per-rank elements of the padded shard layout (the collective's unit)."""
        return sum(s.chunk * s.row_numel for s in self.slots)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world


def make_buckets(params: Sequence[Tuple[str, torch.Size, int, bool]], stage: int, world: int,
                 bucket_numel: int, persist_threshold: int) -> List[Bucket]:
    """Group (name, shape, unit, trainable) in order into buckets of at most bucket_numel.

    A bucket never mixes units, placements or trainability; one parameter larger than
    the limit gets a bucket of its own.
    """
    buckets: List[Bucket] = []
    group: List[Tuple[str, torch.Size]] = []
    key = None

    def close() -> None:
        if group:
            unit, place, trainable = key
            slots, full, shard = [], 0, 0
            for name, shape in group:
                rows = shape[0] if len(shape) else 1
                chunk = max(1, -(-rows // world))
                slot = Slot(name, shape, full, shard, chunk)
                slots.append(slot)
                full += slot.numel
                shard += chunk * slot.row_numel
            buckets.append(Bucket(len(buckets), unit, place, trainable, tuple(slots), world))
            group.clear()

    size = 0
    for name, shape, unit, trainable in params:
        k = (unit, placements_for(stage, shape, persist_threshold), trainable)
        numel = math.prod(shape)
        if k != key or (group and size + numel > bucket_numel):
            close()
            key, size = k, 0
        group.append((name, shape))
        size += numel
    close()
    return buckets
