"""`Steps`: the per-step stream a loader's workers run: ((epoch, index after), this rank's batch).

Each worker reads the whole global stream from the start position and collates the
steps it owns (step k belongs to worker k mod workers), so the loader, taking workers'
results in turn, hands out the steps in order. A map-style dataset's samples are fetched
only for this rank's rows of the worker's own steps; an iterable dataset is read through
(its samples before the start position too, which is how it resumes).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from fz.data.order import Layout, epoch_order
from fz.errors import ConfigError

Fetch = Callable[[int, int], list[Any]]


def unchanged(x: Any) -> Any:
    """The loader's collate_fn: workers already collated each step."""
    return x


class Steps(IterableDataset):
    def __init__(self, dataset: Any, layout: Layout, collate: Callable[[list[Any]], Any], start: tuple[int, int],
                 epochs: int | None, seed: int, shuffle: bool, iterable: bool):
        self.dataset, self.layout, self.collate, self.start = dataset, layout, collate, start
        self.epochs, self.seed, self.shuffle, self.iterable = epochs, seed, shuffle, iterable

    def __iter__(self) -> Iterator[tuple[tuple[int, int], Any]]:
        info = get_worker_info()
        me, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, index = self.start
        step = 0
        while self.epochs is None or epoch < self.epochs:
            made = 0
            for first, take, fetch in (self._read if self.iterable else self._index)(epoch, index):
                if step % workers == me:
                    lo, hi = self.layout.share(take)
                    yield (epoch, first + take), self.collate(fetch(lo, hi))
                step += 1
                made += 1
            if not made and not index:
                raise ConfigError(
                    f"fz.data.loader: epoch {epoch} of the dataset gives no step (a step takes "
                    f"{self.layout.global_rows} samples: {self.layout.world} ranks x {self.layout.rows} rows)"
                )
            epoch, index = epoch + 1, 0

    def _index(self, epoch: int, index: int) -> Iterator[tuple[int, int, Fetch]]:
        order = epoch_order(len(self.dataset), epoch, self.seed, self.shuffle)
        n, full = len(order), self.layout.global_rows
        while index < n and (index + full <= n or not self.layout.drop_last):
            take = min(full, n - index)
            rows = order[index:index + take]

            def fetch(lo: int, hi: int, rows: Any = rows) -> list[Any]:
                return [self.dataset[int(i)] for i in rows[lo:hi]]
            yield index, take, fetch
            index += take

    def _read(self, epoch: int, index: int) -> Iterator[tuple[int, int, Fetch]]:
        it = iter(self.dataset)
        skipped = sum(1 for _ in islice(it, index))
        if skipped < index:
            raise ConfigError(f"fz.data.loader: resuming at sample {index} of epoch {epoch}, but the iterable "
                              f"dataset ends after {skipped} samples (is it the dataset the position was saved with?)")
        full = self.layout.global_rows
        while True:
            chunk = list(islice(it, full))
            if not chunk or (len(chunk) < full and self.layout.drop_last):
                return
            if len(chunk) < self.layout.world:
                raise ConfigError(f"fz.data.loader: the last step of epoch {epoch} has {len(chunk)} samples for "
                                  f"{self.layout.world} ranks; use drop_last=True")

            def part(lo: int, hi: int, chunk: list[Any] = chunk) -> list[Any]:
                return chunk[lo:hi]
            yield index, len(chunk), part
            index += len(chunk)
