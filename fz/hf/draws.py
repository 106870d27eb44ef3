"""Where fz.hf.Trainer draws random numbers: where transformers' Trainer draws them.

A collator that draws random numbers (DataCollatorForLanguageModeling's masks, unseeded) draws
from the process's generator, as the model's dropout and the evaluation's collation do: the
masks a step trains on depend on where each draw falls among the others. transformers reads
its training data through accelerate's DataLoaderShard: each epoch's iterator starts with the
DataLoader's base seed (one draw), and each micro-batch is collated one ahead of the one
handed out (within the epoch). `AsAccelerate` hands out fz.data's steps in that order: fz.data
reads each step's samples with collation deferred, and each micro-batch is collated where
accelerate collates it (with dataloader workers, in the generators of the worker transformers
gives it: worker_draws.py). `train_step` runs the step's dropout on the process's generator,
not the State's own.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

import fz
from fz.hf import data, worker_draws
from fz.hf.worker_draws import WorkerGenerators
from fz.rng import capture, restore


@dataclass(frozen=True)
class Rows:
    """A micro-batch's samples, read and not yet collated."""

    samples: list[Any]


def deferred(samples: list[Any]) -> Rows:
    """fz.data's collate_fn here: the collation is AsAccelerate's."""
    return Rows(samples)


class AsAccelerate:
    """fz.data's loader handing out MicroBatches in accelerate's order (its collate_fn `deferred`:
    each micro-batch collated here with `collate`, in `workers`' generators when given; or
    collated by fz.data's workers, `collate` unused). `epoch`, `state_dict()` and `attach()` are
    those of the step handed out; `ends_epoch` says whether it is its epoch's last (the next
    epoch's reads wait for the next step)."""

    def __init__(self, loader: Any, collate: Callable[[list[Any]], Any], workers: WorkerGenerators | None = None):
        self.loader, self.collate, self.workers = loader, collate, workers
        self._k = 0  # micro-batches of the epoch's DataLoader iterator read so far
        self.dataset = loader.dataset
        self._position: dict[str, Any] = loader.state_dict()
        self.ends_epoch = False

    @property
    def epoch(self) -> int:
        return int(self._position["epoch"])

    def state_dict(self) -> dict[str, Any]:
        return dict(self._position)

    @property
    def at_epoch_start(self) -> bool:
        """Before the first step is handed out: whether it opens an epoch (fz.data.Loader's)."""
        return bool(self.loader.at_epoch_start)

    def attach(self, state: fz.State) -> fz.State:
        return self.loader.attach(state, position=self._position)

    def seek(self, epoch: int) -> None:
        """The next iteration reads `epoch` from its start (a callback's should_epoch_stop)."""
        self.loader.seek(epoch)
        self._position, self.ends_epoch = self.loader.state_dict(), False

    def _read(self, batches: Any) -> list[Any]:
        """A step's micro-batches, each with its number in the epoch's DataLoader iterator."""
        out = [(self._k + i, x) for i, x in enumerate(batches)]
        self._k += len(out)
        return out

    def _done(self, item: tuple[int, Any]) -> Any:
        k, x = item
        if not isinstance(x, Rows):
            return x
        return self.collate(x.samples) if self.workers is None else self.workers.collate(k, self.collate, x.samples)

    def _start_epoch(self, resumed_within_epoch: bool) -> None:
        """The epoch's DataLoader iterator starts: its base seed (one draw), its workers seeded."""
        self._k = 0
        if self.workers is not None and not self.workers.draws_base(resumed_within_epoch):
            return  # persistent workers: their generators go on
        base = int(torch.empty((), dtype=torch.int64).random_().item())
        if self.workers is not None:
            self.workers.seed(base)

    def _hand_out(self, position: dict[str, Any], batches: list[Any], ends_epoch: bool) -> fz.MicroBatches:
        self._position, self.ends_epoch = position, ends_epoch
        return fz.MicroBatches(batches)

    def __iter__(self) -> Iterator[fz.MicroBatches]:
        held: tuple[dict[str, Any], list[Any]] | None = None
        within = not self.loader.at_epoch_start  # a resume inside an epoch
        for batches in self.loader:
            position = self.loader.state_dict()
            if held is not None and position["epoch"] != held[0]["epoch"]:  # the epoch ended: none read ahead
                yield self._hand_out(held[0], [self._done(x) for x in held[1]], True)
                held = None
            if held is None:
                self._start_epoch(within)
                order = getattr(self.loader, "order", None)
                if getattr(order, "draws_global", False):  # transformers' LengthGroupedSampler's shuffle
                    torch.randperm(len(self.dataset))
                pending = self._read(batches)
                pending[0] = (pending[0][0], self._done(pending[0]))
            else:
                done = [self._done(x) for x in held[1]]
                pending = self._read(batches)
                pending[0] = (pending[0][0], self._done(pending[0]))  # accelerate's one micro-batch ahead
                yield self._hand_out(held[0], done, False)
            held = (position, pending)
        if held is not None:
            yield self._hand_out(held[0], [self._done(x) for x in held[1]], True)


def reading(args: Any, dataset: Any, state: fz.State, collate: Callable[[list[Any]], Any], *, micro: int | None,
            order: Any) -> AsAccelerate:
    """The Trainer's training data as accelerate hands it out. With dataloader workers, fz.data's
    read the samples; a map-style dataset's micro-batches are collated here, in the generators of
    transformers' workers (worker_draws.py), an iterable one's by fz.data's workers (their own
    generators: transformers seeds no worker for one)."""
    workers = worker_draws.of(args, dataset)
    theirs = bool(args.dataloader_num_workers) and workers is None
    made = data.train_loader(args, dataset, state, collate if theirs else deferred, micro=micro, order=order)
    return AsAccelerate(made, collate, workers)


def train_step(state: fz.State, batches: fz.MicroBatches) -> tuple[fz.State, torch.Tensor]:
    """fz.train_step with dropout drawn from this process's generator (seeded by transformers'
    set_seed, drawn by collators too), as the model's forward draws it under transformers."""
    device = state.plan.device
    state, loss = fz.train_step(state.replace(rng=capture(device)), batches)
    restore(state.rng, device)
    return state, loss
