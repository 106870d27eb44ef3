"""The training data of `fz.hf.Trainer`, in the order and micro-batches transformers' Trainer reads.

transformers' Trainer reads its training set through accelerate: a `SeedableRandomSampler`
(epoch e is `torch.randperm(n)` from a generator seeded with seed + e) or a sequential one,
cut into batches of `per_device_train_batch_size` that go to the ranks in turn, each collated
on its own; `gradient_accumulation_steps` of them make a step, and an epoch's last step takes
what is left, its last micro-batch filled up with the epoch's first samples on several ranks
(`even_batches`; one process, which accelerate does not shard, trains it short).
`fz.data.loader(..., split=True)` reads the same samples into the same micro-batches
(fz/data/order.py, checked against accelerate in tests/unit/test_data_split.py) and keeps the
position in the State, so a resume continues at the exact next sample at any world size.
`dataloader_drop_last` keeps only whole micro-batches, as in transformers.
"""
from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

import fz
from fz.data import Layout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TorchOrder:
    """accelerate's SeedableRandomSampler: epoch e is randperm(n) seeded with seed + e (picklable,
    for the loader's workers)."""

    seed: int

    def __call__(self, epoch: int, size: int) -> torch.Tensor:
        return torch.randperm(size, generator=torch.Generator().manual_seed(self.seed + epoch))


@dataclass(frozen=True)
class LengthGroupedOrder:
    """transformers' group_by_length: its LengthGroupedSampler's indices (a shuffle cut into
    mega-batches of up to 50 steps' rows, each sorted longest first, the longest row first of all),
    the shuffle seeded by seed + epoch as SeedableRandomSampler's is. transformers draws that
    shuffle from the process's generator, which no resume can draw again; fz's resumes at the
    exact next sample. `draws_global`: the draw transformers makes there all the same (draws.py)."""

    seed: int
    lengths: tuple[int, ...]
    batch: int  # transformers' train_batch_size x gradient_accumulation_steps
    draws_global = True

    def __call__(self, epoch: int, size: int) -> torch.Tensor:
        from transformers.trainer_pt_utils import get_length_grouped_indices

        if size != len(self.lengths):
            raise fz.ConfigError(f"group_by_length: {len(self.lengths)} lengths for a dataset of {size} rows")
        shuffle = torch.Generator().manual_seed(self.seed + epoch)
        return torch.tensor(get_length_grouped_indices(list(self.lengths), self.batch, generator=shuffle))


def length_grouped(trainer: Any, dataset: Any) -> LengthGroupedOrder | None:
    """The order of `train_sampling_strategy="group_by_length"` (None otherwise, or for a dataset
    without a length, which transformers reads in its own order and says so): the lengths and
    batch transformers' own _get_train_sampler gives its LengthGroupedSampler."""
    if sampling(trainer.args) != "group_by_length":
        return None
    import transformers

    own = transformers.Trainer._get_train_sampler
    takes_dataset = len(inspect.signature(own).parameters) > 1  # transformers < 4.53 reads self.train_dataset
    sampler: Any = own(trainer, dataset) if takes_dataset else own(trainer)
    if sampler is None:
        return None
    log.warning("fz.hf.Trainer: group_by_length groups rows as transformers does; its shuffle is seeded by "
                "data_seed + epoch (transformers draws it from the process's generator, which a resume "
                "cannot draw again), so the groups differ from transformers' run")
    return LengthGroupedOrder(data_seed(trainer.args), tuple(int(n) for n in sampler.lengths), int(sampler.batch_size))


def sampling(args: Any) -> str:
    """The training data order transformers would use ("group_by_length" was a flag before 5.0)."""
    if getattr(args, "group_by_length", False):
        return "group_by_length"
    return str(getattr(args, "train_sampling_strategy", "random"))


def data_seed(args: Any) -> int:
    """The sampler's seed: data_seed, else seed (transformers' Trainer seeds torch with it first)."""
    return int(args.data_seed if args.data_seed is not None else args.seed)


def layout(args: Any, micro: int | None = None) -> Layout:
    """This rank's share of each step: `micro` (per_device_train_batch_size) x gradient_accumulation_steps
    rows in micro-batches of their own; an epoch's last, smaller step is trained."""
    micro = int(args.per_device_train_batch_size) if micro is None else micro
    world = max(1, int(args.world_size))
    rank = int(args.process_index) if world > 1 else 0
    drop: Literal["micro_batch"] | bool = "micro_batch" if args.dataloader_drop_last else False
    return Layout(micro * int(args.gradient_accumulation_steps), world, rank, drop, micro)


def steps_per_epoch(args: Any, dataset: Any, micro: int | None = None) -> int | None:
    """Optimizer steps in one epoch of `dataset` (None: it has no length)."""
    return layout(args, micro).steps_in(len(dataset)) if hasattr(dataset, "__len__") else None


def epoch_progress(args: Any, position: dict[str, Any], size: int | None, max_steps: int,
                   micro: int | None = None) -> float:
    """transformers' `state.epoch` after a step: the epoch plus the share of its micro-batches done
    (of an iterable dataset's, max_steps x gradient_accumulation_steps, as transformers counts them)."""
    epoch, index = int(position["epoch"]), int(position["index"])
    lay = layout(args, micro)
    whole = lay.world * int(lay.micro or 1)  # samples of one micro-batch of every rank
    if not size:
        return epoch + math.ceil(index / whole) / (max_steps * int(args.gradient_accumulation_steps))
    kept = size - (size % lay.global_rows) + lay.take(size % lay.global_rows)
    done = min(index, kept)
    return epoch + math.ceil(done / whole) / math.ceil(kept / whole)


def train_loader(args: Any, dataset: Any, state: fz.State, collate: Any, micro: int | None = None,
                 order: Any = None) -> fz.data.Loader:
    """The loader of MicroBatches fz.hf.Trainer trains on (starting where `state.data` says): in
    transformers' order, or in `order` (an online trainer's sampler, fz/hf/online.py)."""
    lay = layout(args, micro)
    shuffle = (order is not None or sampling(args) == "random") and hasattr(dataset, "__len__")
    if shuffle and order is None:
        order = TorchOrder(data_seed(args))
    if state.spec.micro_batch not in (None, lay.micro):  # an online trainer's generation batches: not what it trains
        state = state.replace(spec=state.spec.replace(micro_batch=None))
    return fz.data.loader(dataset, state, micro_batch=lay.micro, shuffle=shuffle, seed=data_seed(args),
                          num_workers=int(args.dataloader_num_workers), collate_fn=collate, drop_last=lay.drop_last,
                          split=True, order=order)


class _TrainLoaderView:
    """What accelerate's DataLoaderShard tells its GradientState while transformers' loop reads an
    epoch: `end_of_dataloader` through the epoch's last step (its micro-batches are read ahead),
    and `remainder`, the samples of the last global batch (len % (batch x ranks); -1 without a
    length or with drop_last). gather_for_metrics keeps only that many entries there (TRL's
    num_tokens, mean_token_accuracy...): without it they counted the samples even_batches fills in."""

    def __init__(self, remainder: int):
        self.end_of_dataloader, self.remainder = False, remainder


def tell_accelerate(trainer: Any, ends_epoch: bool | None) -> None:
    """Before a step's forwards: accelerate's GradientState as its training dataloader would set it
    (`ends_epoch` None: training ended, the dataloader is gone from it)."""
    state = getattr(getattr(trainer, "accelerator", None), "gradient_state", None)
    if state is None or not hasattr(state, "_add_dataloader"):  # accelerate's own, private
        return
    view = trainer.__dict__.get("_fz_loader_view")
    if ends_epoch is None:
        if view is not None:
            state._remove_dataloader(trainer.__dict__.pop("_fz_loader_view"))
        return
    if view is None:
        dataset, args = trainer.train_dataset, trainer.args
        try:
            length = getattr(dataset, "total_dataset_length", len(dataset))
            remainder = -1 if args.dataloader_drop_last else length % (trainer._train_batch_size * args.world_size)
        except TypeError:  # no length
            remainder = -1
        view = trainer.__dict__["_fz_loader_view"] = _TrainLoaderView(remainder)
        state._add_dataloader(view)  # held weakly there: it goes with the trainer
    view.end_of_dataloader = ends_epoch
