"""Flat buckets: the parameters one collective moves, and where each lives inside them."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch.distributed.tensor import Shard

from fz.sharding.stages import Placements, placements_for


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

    def local_rows(self, rank: int) -> tuple[int, int]:
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
    slots: tuple[Slot, ...]
    shards: int  # ranks the bucket is sharded over (the shard group)

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
        return self.shard_numel * self.shards

    def shard_gaps(self, rank: int) -> list[tuple[int, int]]:
        """[lo, hi) element ranges of `rank`'s shard that hold no parameter's rows (the zero padding)."""
        gaps, at = [], 0
        for s in self.slots:
            start, stop = s.local_rows(rank)
            gaps.append((at, s.shard_offset))
            at = s.shard_offset + (stop - start) * s.row_numel
        gaps.append((at, self.shard_numel))
        return [(lo, hi) for lo, hi in gaps if hi > lo]


def make_buckets(params: Sequence[tuple[str, torch.Size, int, bool]], stage: int, shards: int,
                 bucket_numel: int, persist_threshold: int) -> list[Bucket]:
    """Group (name, shape, unit, trainable) in order into buckets of at most bucket_numel.

    A bucket never mixes units, placements or trainability; one parameter larger than
    the limit gets a bucket of its own.
    """
    buckets: list[Bucket] = []
    group: list[tuple[str, torch.Size]] = []
    key: tuple[int, Placements, bool] | None = None

    def close() -> None:
        if group:
            assert key is not None  # set with the group's first parameter
            unit, place, trainable = key
            slots, full, shard = [], 0, 0
            for name, shape in group:
                rows = shape[0] if len(shape) else 1
                chunk = max(1, -(-rows // shards))
                slot = Slot(name, shape, full, shard, chunk)
                slots.append(slot)
                full += slot.numel
                shard += chunk * slot.row_numel
            buckets.append(Bucket(len(buckets), unit, place, trainable, tuple(slots), shards))
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
