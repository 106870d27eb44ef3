"""`Steps`: the per-step stream a loader's workers run: ((epoch, index after), this rank's batch).

Each worker reads the whole global stream from the start position and collates the
steps it owns (step k belongs to worker k mod workers), so the loader, taking workers'
results in turn, hands out the steps in order. A map-style dataset's samples are fetched
only for this rank's rows of the worker's own steps; an iterable dataset is read through
(its samples before the start position too, which is how it resumes).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from fz.data.order import Layout, epoch_order
from fz.errors import ConfigError
from fz.step.batches import MicroBatches

log = logging.getLogger(__name__)
SAY_EVERY_S = 30.0  # how often a long read past an iterable dataset's used samples says how far it is

Fetch = Callable[[int, int], list[Any]]
Order = Callable[[int, int], Any]  # (epoch, size) -> that epoch's sample indices


def unchanged(x: Any) -> Any:
    """The loader's collate_fn: workers already collated each step."""
    return x


class Steps(IterableDataset):
    def __init__(self, dataset: Any, layout: Layout, collate: Callable[[list[Any]], Any], start: tuple[int, int],
                 epochs: int | None, seed: int, shuffle: bool, iterable: bool, order: Order | None = None):
        self.dataset, self.layout, self.collate, self.start = dataset, layout, collate, start
        self.epochs, self.seed, self.shuffle, self.iterable, self.order = epochs, seed, shuffle, iterable, order

    def __iter__(self) -> Iterator[tuple[tuple[int, int], Any]]:
        info = get_worker_info()
        me, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, index = self.start
        step = 0
        while self.epochs is None or epoch < self.epochs:
            made = 0
            for first, take, fetch in (self._read if self.iterable else self._index)(epoch, index):
                if step % workers == me:
                    yield (epoch, first + take), self._batch(take, fetch)
                step += 1
                made += 1
            if not made and not index:
                raise ConfigError(
                    f"fz.data.loader: epoch {epoch} of the dataset gives no step (a step takes "
                    f"{self.layout.global_rows} samples: {self.layout.world} ranks x {self.layout.rows} rows)"
                )
            epoch, index = epoch + 1, 0

    def _batch(self, take: int, fetch: Fetch) -> Any:
        """This rank's batch of a step of `take` samples: one collated batch, or (split) its
        micro-batches, each collated on its own."""
        if self.layout.micro is None:
            return self.collate(fetch(*self.layout.share(take)))
        return MicroBatches(self.collate(fetch(lo, hi)) for lo, hi in self.layout.micro_shares(take))

    def _index(self, epoch: int, index: int) -> Iterator[tuple[int, int, Fetch]]:
        n = len(self.dataset)
        order = torch.as_tensor(self.order(epoch, n)) if self.order is not None else \
            epoch_order(n, epoch, self.seed, self.shuffle)
        if len(order) != n:
            raise ConfigError(f"fz.data.loader: order({epoch}, {n}) gave {len(order)} indices for {n} samples")
        while index < n:
            take = self.layout.take(n - index)
            if not take:
                return
            rows = order[index:index + take]
            if self.layout.filled(take) > take:  # a last micro-batch filled up with the epoch's first samples
                rows = torch.cat([rows, order[torch.arange(self.layout.filled(take) - take) % n]])

            def fetch(lo: int, hi: int, rows: Any = rows) -> list[Any]:
                return [self.dataset[int(i)] for i in rows[lo:hi]]
            yield index, take, fetch
            index += take

    def _read(self, epoch: int, index: int) -> Iterator[tuple[int, int, Fetch]]:
        it = iter(self.dataset)
        head = list(islice(it, min(index, self.layout.global_rows)))  # the epoch's first samples fill a last step
        skipped = len(head) + _read_past(it, index - len(head), index, epoch)
        if skipped < index:
            raise ConfigError(f"fz.data.loader: resuming at sample {index} of epoch {epoch}, but the iterable "
                              f"dataset ends after {skipped} samples (is it the dataset the position was saved with?)")
        full = self.layout.global_rows
        while True:
            chunk = list(islice(it, full))
            if len(head) < full:
                head += chunk[:full - len(head)]
            chunk = chunk[:self.layout.take(len(chunk))]
            if not chunk:
                return
            take = len(chunk)
            if self.layout.filled(take) > take:
                chunk += [head[i % len(head)] for i in range(self.layout.filled(take) - take)]
            if len(chunk) < self.layout.world:
                raise ConfigError(f"fz.data.loader: the last step of epoch {epoch} has {len(chunk)} samples for "
                                  f"{self.layout.world} ranks; use drop_last=True")

            def part(lo: int, hi: int, chunk: list[Any] = chunk) -> list[Any]:
                return chunk[lo:hi]
            yield index, take, part
            index += take


def _read_past(it: Iterator[Any], n: int, index: int, epoch: int) -> int:
    """Read past `n` samples of `it` (resuming an iterable dataset at sample `index`: as long as reading
    them takes), saying so, and how far it is every SAY_EVERY_S seconds; the samples read past."""
    if n <= 0:
        return 0
    log.info("fz.data: resuming an iterable dataset at sample %d of epoch %d: reading past the samples before it",
             index, epoch)
    done, said = 0, time.monotonic()
    while done < n:
        got = sum(1 for _ in islice(it, min(n - done, 1024)))  # the clock read every 1024 samples
        done += got
        if not got:
            break
        if time.monotonic() - said >= SAY_EVERY_S:
            log.info("fz.data: read past %d of %d samples", done, n)
            said = time.monotonic()
    return done
