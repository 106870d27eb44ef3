"""The global sample order, and how one step's global batch is cut into ranks' batches.

The rule that makes a resume exact at any world size: samples form one global stream,
epoch after epoch (epoch e of a map-style dataset is a permutation seeded by (seed, e),
or 0..n-1 unshuffled; an iterable dataset is read in its own order). A step takes the
next `world * rows` samples of the stream and rank r gets the r-th `rows` of them, so
the position (epoch, samples of the epoch consumed) is the same on every rank and does
not depend on the world size. Restored at another world size, the stream continues at
that position: no sample is repeated or skipped. With `drop_last`, an epoch's last
samples that do not fill a global batch are skipped (the count depends on the world size).

Split into micro-batches (`micro`, the loader's `split=True`), micro-batch i of a step takes
the step's samples [i * world * micro, (i + 1) * world * micro) and rank r the r-th `micro` of
them, as accelerate shards transformers' Trainer's batches. An epoch's last, smaller step has
as many micro-batches as its samples start, and its last one is filled up with the epoch's
first samples, as accelerate's `even_batches` fills it (every rank needs its rows; one
process keeps it short, as accelerate, which then does not shard), unless
`drop_last="micro_batch"` leaves it out (transformers' dataloader_drop_last).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from fz.model.materialize import module_seed


def epoch_order(size: int, epoch: int, seed: int, shuffle: bool) -> Tensor:
    """Sample indices of one epoch, in the order every rank reads them."""
    if not shuffle:
        return torch.arange(size)
    g = torch.Generator().manual_seed(module_seed(seed, f"fz.data/epoch{epoch}"))
    return torch.randperm(size, generator=g)


@dataclass(frozen=True)
class Layout:
    """One step: `rows` samples per rank, `world` ranks; this is rank `rank`."""

    rows: int
    world: int
    rank: int
    drop_last: bool | Literal["micro_batch"] = True
    micro: int | None = None  # split: rows per micro-batch; None: each rank's rows of a step as one batch

    @property
    def global_rows(self) -> int:
        return self.rows * self.world

    def take(self, left: int) -> int:
        """Samples the next step takes when `left` remain in the epoch (0: the epoch is over)."""
        if left >= self.global_rows:
            return self.global_rows
        if self.drop_last is True:
            return 0
        if self.micro is None or self.drop_last is False:
            return left
        whole = self.world * self.micro  # "micro_batch": whole micro-batches of every rank only
        return left // whole * whole

    def filled(self, take: int) -> int:
        """The samples a step of `take` holds: with split micro-batches, whole ones (the last filled
        up with the epoch's first samples); else `take`."""
        if self.micro is None or self.world == 1:  # one process: accelerate does not shard, the last one is short
            return take
        whole = self.world * self.micro
        return -(-take // whole) * whole

    def micro_shares(self, take: int) -> list[tuple[int, int]]:
        """This rank's [lo, hi) of each micro-batch of a step of `take` samples; past `take` the
        step continues with the epoch's first samples (see the module)."""
        assert self.micro is not None
        whole = self.world * self.micro
        return [(start + self.rank * self.micro, min(start + (self.rank + 1) * self.micro, self.filled(take)))
                for start in range(0, take, whole)]

    def share(self, take: int) -> tuple[int, int]:
        """This rank's [lo, hi) of a step of `take` samples: `rows` each for a full step, as even
        as possible (earlier ranks one more) for an epoch's last, smaller one."""
        base, extra = divmod(take, self.world)
        lo = self.rank * base + min(self.rank, extra)
        return lo, lo + base + (self.rank < extra)

    def steps_in(self, size: int, start: int = 0) -> int:
        """Steps an epoch of `size` samples gives from sample `start` on."""
        left = max(size - start, 0)
        full, rest = divmod(left, self.global_rows)
        return full + (1 if self.take(rest) else 0)
