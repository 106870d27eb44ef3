"""The generators transformers' training DataLoader workers collate with, kept in this process.

With `dataloader_num_workers` W, transformers' Trainer reads a map-style training set through
torch's DataLoader (in order, round robin): a rank's micro-batch k of a DataLoader iterator
is collated by worker k mod W. torch seeds worker w with base + w (base: the iterator's one
draw from the process's generator) and transformers' `seed_worker` then seeds `random`,
numpy and torch with (base + w) % 2**32 + W * rank. A collator that draws random numbers
(DataCollatorForLanguageModeling's masks) draws from those. fz.data's workers read the
samples; each micro-batch is collated here, in the generators of the worker transformers
would give it, so the masks are transformers'. With `dataloader_persistent_workers` the
workers, and their generators, last from epoch to epoch: only a DataLoader's first iterator
draws a base.
"""
from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

Generators = tuple[torch.Tensor, Any, Any]  # torch's CPU generator, random's, numpy's


def _capture() -> Generators:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _set(states: Generators) -> None:
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np.random.set_state(states[2])


def worker_seed(base: int, worker: int, workers: int, rank: int) -> int:
    """The seed transformers' `seed_worker` gives `worker` (before 4.50 it took no rank)."""
    from transformers.trainer_utils import seed_worker

    initial = (base + worker) % 2**32  # torch.initial_seed() in the worker, mod 2**32
    return initial + workers * rank if "rank" in inspect.signature(seed_worker).parameters else initial


class WorkerGenerators:
    """Each training DataLoader worker's generators, as transformers' Trainer would have them."""

    def __init__(self, workers: int, rank: int, persistent: bool):
        self.workers, self.rank, self.persistent = workers, rank, persistent
        self._states: list[Generators] = []
        self._iterators = 0
        self._first_resumed = False  # the first iterator read a resumed epoch (a DataLoader of its own)

    def draws_base(self, resumed_within_epoch: bool) -> bool:
        """Whether the DataLoader iterator an epoch reads with starts anew (and draws a base):
        always without persistent workers; with them, only the first epoch's (and, when the first
        read a resumed epoch, which transformers reads through a DataLoader of its own, the next's).
        `resumed_within_epoch`: whether this train() started inside an epoch (read at the first)."""
        self._iterators += 1
        if self._iterators == 1:
            self._first_resumed = resumed_within_epoch
        return not self.persistent or self._iterators == 1 or (self._iterators == 2 and self._first_resumed)

    def seed(self, base: int) -> None:
        """A DataLoader iterator's start: each worker seeded from `base`, as seed_worker seeds it."""
        own = _capture()
        try:
            states = []
            for w in range(self.workers):
                s = worker_seed(base, w, self.workers, self.rank)
                random.seed(s)
                np.random.seed(s)
                torch.default_generator.manual_seed(s)  # the CPU generator only: CUDA's stays the process's
                states.append(_capture())
        finally:
            _set(own)
        self._states = states

    def collate(self, k: int, collate: Callable[[list[Any]], Any], samples: list[Any]) -> Any:
        """Micro-batch `k` of the iterator, collated in the generators of worker k mod W."""
        w = k % self.workers
        own = _capture()
        _set(self._states[w])
        try:
            return collate(samples)
        finally:
            self._states[w] = _capture()
            _set(own)


def of(args: Any, dataset: Any) -> WorkerGenerators | None:
    """The workers' generators of transformers' training DataLoader (None without workers, or for an
    iterable dataset: transformers seeds its workers only for a map-style one, and fz.data's collate)."""
    workers = int(args.dataloader_num_workers)
    if not workers or isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        return None
    persistent = bool(getattr(args, "dataloader_persistent_workers", False))
    return WorkerGenerators(workers, int(args.process_index), persistent)
