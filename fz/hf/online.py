"""TRL's online trainers (`GRPOTrainer`, `RLOOTrainer`) on fz: each step's micro-batches made by
the trainer's own `_prepare_inputs`, the policy generating with the State's current weights.

These trainers read a *generation* batch per micro-step (per_device_train_batch_size x
steps_per_generation rows, each prompt repeated num_generations times by TRL's RepeatSampler,
and the whole block repeated num_iterations x steps_per_generation times). Their
`_prepare_inputs` generates completions with `trainer.model`, scores them (reward functions, the
reference model, the old policy's log-probabilities) and hands out one slice per micro-step,
generating anew every steps_per_generation x num_iterations micro-steps; their `training_step`
only counts those micro-steps (`trainer._step`) and times them. fz's loop:

- reads the rows the trainer's sampler gives, epoch after epoch (its generator runs on from one
  epoch to the next, as it does under transformers), in micro-batches of the generation batch,
  sharded to the ranks as accelerate shards them, the position kept in the State;
- fills `trainer.model` with the State's weights once per update, before the trainer's code
  runs it, and lets them go after (every rank, as DeepSpeed's ZeRO-3 gathers the weights for
  generation and releases them; fz/hf/model_weights.py);
- calls `_prepare_inputs` on each micro-batch and counts `_step` and `step_time` as the
  trainers' `training_step` does, then trains the prepared micro-batches in one fz.train_step
  (their `compute_loss`, with TRL's own loss normalisation).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

import fz
from fz.errors import ConfigError
from fz.hf import draws

# TRL's trainers whose `_prepare_inputs` makes a step's inputs by generating, and whose
# `training_step` only counts micro-steps (replicated by `prepare`)
ONLINE = ("GRPOTrainer", "RLOOTrainer", "DistillationTrainer")


def online_class(trainer: Any) -> type | None:
    """TRL's online trainer class `trainer` is (or derives from), else None."""
    for klass in type(trainer).__mro__:  # the class defining them (fz.hf.on_fz's is named as it is)
        if klass.__name__ in ONLINE and klass.__module__.startswith("trl.") and "_prepare_inputs" in vars(klass):
            return klass
    return None


def refused(trainer: Any) -> list[str]:
    """An online trainer's settings fz would not honour, worded (none for any other trainer)."""
    if online_class(trainer) is None or getattr(trainer.args, "ds3_gather_for_generation", True):
        return []
    return ["ds3_gather_for_generation=False: fz generates with the whole weights in trainer.model, copied from the "
            "State once per update (DeepSpeed's True); generating from ZeRO-3 shards layer by layer is not fz's"]


@dataclass(frozen=True)
class RepeatOrder:
    """TRL's RepeatSampler, epoch by epoch: epoch e is the sampler's (e+1)-th pass, its generator
    seeded once, as the one sampler transformers' loader iterates each epoch (picklable, for the
    loader's workers)."""

    mini_repeat_count: int
    batch_size: int
    repeat_count: int
    shuffle: bool
    seed: int | None
    samples: int

    def __call__(self, epoch: int, size: int) -> torch.Tensor:
        from trl.trainer.utils import RepeatSampler
        sampler = RepeatSampler(range(self.samples), self.mini_repeat_count, self.batch_size, self.repeat_count,
                                self.shuffle, self.seed)
        indices: list[int] = []
        for _ in range(epoch + 1):
            indices = list(sampler)
        return torch.tensor(indices, dtype=torch.int64)


class Repeated(Dataset):
    """`dataset` read through a RepeatOrder: as many rows as the sampler yields an epoch, row i
    being the dataset's row i (the order's indices are the dataset's own)."""

    def __init__(self, dataset: Any, rows: int):
        self.dataset, self.rows = dataset, rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]


def reads(trainer: Any, dataset: Any) -> tuple[Any, int, RepeatOrder | None]:
    """(what fz.data reads, rows of a micro-batch, order) of an online trainer's training set: its
    generation batches in its sampler's order, as its get_train_dataloader reads them."""
    args = trainer.args
    per_generation = getattr(args, "steps_per_generation", None) or args.gradient_accumulation_steps  # distillation
    micro = int(args.per_device_train_batch_size) * int(per_generation)
    stream = isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__")
    sampler = trainer._get_train_sampler(range(0) if stream else dataset)  # its sizes come from the arguments
    names = ("mini_repeat_count", "batch_size", "repeat_count", "shuffle", "seed")
    if type(sampler).__name__ != "RepeatSampler" or not all(hasattr(sampler, n) for n in names):
        raise ConfigError(f"fz.hf: {type(trainer).__name__}._get_train_sampler gives a {type(sampler).__name__}; fz "
                          "reads an online trainer's data in the order of TRL's RepeatSampler only")
    if stream:  # as the trainers' get_train_dataloader: a buffered shuffle, then the sampler's repeats
        from trl.trainer.utils import repeat_iterable_dataset
        if not hasattr(dataset, "map"):
            raise ConfigError(f"fz.hf: {type(trainer).__name__} streams a datasets.IterableDataset (TRL repeats its "
                              f"rows with IterableDataset.map); got {type(dataset).__name__}")
        if sampler.shuffle:
            dataset = dataset.shuffle(seed=sampler.seed)
        return repeat_iterable_dataset(dataset, mini_repeat_count=sampler.mini_repeat_count,
                                       batch_size=sampler.batch_size, repeat_count=sampler.repeat_count), micro, None
    order = RepeatOrder(**{n: getattr(sampler, n) for n in names}, samples=len(dataset))
    return Repeated(dataset, len(sampler)), micro, order


def pull(trainer: Any) -> None:
    """The State's weights into `trainer.model`, if it does not hold this update's yet: the model
    the trainer's own code generates with and scores (every rank calls it, in step)."""
    state = trainer.fz_ready()
    if not trainer._fz_released and getattr(trainer, "_fz_pulled_step", None) == int(state.step):
        return
    trainer._copy_weights_into_model()
    trainer._fz_pulled_step = int(state.step)


@contextlib.contextmanager
def weights_held(trainer: Any) -> Iterator[None]:
    """An online trainer's `trainer.model` holding the State's weights inside (let go after, if
    training); for any other trainer, nothing."""
    if online_class(trainer) is None:
        yield
        return
    pull(trainer)
    try:
        yield
    finally:
        if trainer.is_in_train:
            trainer._let_go_of_weights()


def train_step(trainer: Any, batches: fz.MicroBatches) -> fz.State:
    """One update of an online trainer: its inputs made (`prepare`), then trained; timed."""
    prepared, seconds = prepare(trainer, batches)
    started = time.perf_counter()
    state, _ = draws.train_step(trainer.fz_state, prepared)
    step_time(trainer, seconds + time.perf_counter() - started)
    return state


def prepare(trainer: Any, batches: fz.MicroBatches) -> tuple[fz.MicroBatches, float]:
    """Each micro-batch's inputs, made by the trainer's `_prepare_inputs` from its generation batch
    with the current weights, `trainer._step` counted as its training_step counts it; and the
    seconds it took."""
    start = time.perf_counter()
    pull(trainer)
    prepared = []
    for batch in batches:
        prepared.append(trainer._prepare_inputs(batch))
        trainer._step += 1
    trainer._let_go_of_weights()  # until the next generation (fz/hf/model_weights.py)
    return fz.MicroBatches(prepared), time.perf_counter() - start


def step_time(trainer: Any, seconds: float) -> None:
    """The trainers' `step_time` metric, once per update as their training_step records it."""
    trainer._current_train_step_time += seconds
    if trainer._step % trainer.current_gradient_accumulation_steps == 0:
        trainer._metrics["train"]["step_time"].append(trainer._current_train_step_time)
        trainer._current_train_step_time = 0.0
