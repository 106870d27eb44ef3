"""The global sample order, and how one step's global batch is cut into ranks' batches.

The rule that makes a resume exact at any world size: samples form one global stream,
epoch after epoch (epoch e of a map-style dataset is a permutation seeded by (seed, e),
or 0..n-1 unshuffled; an iterable dataset is read in its own order). A step takes the
next `world * rows` samples of the stream and rank r gets the r-th `rows` of them, so
the position (epoch, samples of the epoch consumed) is the same on every rank and does
not depend on the world size. Restored at another world size, the stream continues at
that position: no sample is repeated or skipped. With `drop_last`, an epoch's last
samples that do not fill a global batch are skipped (the count depends on the world size).
"""
from __future__ import annotations

from dataclasses import dataclass

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
    drop_last: bool = True

    @property
    def global_rows(self) -> int:
        return self.rows * self.world

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
        return full + (1 if rest and not self.drop_last else 0)
