"""`fz.data.loader`: this rank's batch for each step, resumable exactly from `state.data`.

    loader = fz.data.loader(dataset, state, micro_batch=8)   # starts where state.data says
    for batch in loader:                                     # epoch after epoch
        state, loss = fz.train_step(state, batch)
        if int(state.step) % 100 == 0:
            ckpt.save(loader.attach(state))                  # the position goes into state.data

Workers, prefetching and collation run in torchdata's StatefulDataLoader; fz keeps the
position itself, as the global (epoch, samples consumed) of fz/data/order.py rather than
the loader's per-rank state_dict, so a restore continues at the exact next sample on
any world size, with any number of workers.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, default_collate
from torchdata.stateful_dataloader import StatefulDataLoader

from fz.data.order import Layout
from fz.data.steps import Order, Steps, unchanged
from fz.errors import ConfigError
from fz.model.materialize import module_seed
from fz.spec import Spec
from fz.state import State

FORMAT = 1


class Loader:
    """An endless (or `epochs`-long) stream of this rank's batches; see `fz.data.loader`."""

    def __init__(self, dataset: Any, layout: Layout, *, seed: int, shuffle: bool, num_workers: int,
                 collate_fn: Callable[[list[Any]], Any], epochs: int | None, key: str,
                 position: dict[str, Any] | None = None, order: Order | None = None):
        self.dataset, self.layout, self.seed, self.shuffle = dataset, layout, seed, shuffle
        self.num_workers, self.collate_fn, self.epochs, self.key = num_workers, collate_fn, epochs, key
        self.order = order
        self.iterable = _is_iterable(dataset)
        self.size = None if self.iterable else len(dataset)
        self._pos = (0, 0)
        if position is not None:
            self._pos = self._check(position)

    @property
    def epoch(self) -> int:
        """The epoch of the last batch handed out (0 before the first)."""
        return self._pos[0]

    @property
    def at_epoch_start(self) -> bool:
        """Whether the next batch opens an epoch: at its first sample, or (map-style) past the last
        step of the one before (a position saved at an epoch's end)."""
        index = self._pos[1]
        return not index or (self.size is not None and not self.layout.steps_in(self.size, index))

    @property
    def steps_per_epoch(self) -> int | None:
        """Steps in a whole epoch (map-style datasets; None for an iterable one)."""
        return None if self.size is None else self.layout.steps_in(self.size)

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed out: the same on every rank, at any world size."""
        return {"format": FORMAT, "epoch": self._pos[0], "index": self._pos[1], "seed": self.seed,
                "shuffle": self.shuffle, "size": self.size}

    def attach(self, state: State, position: dict[str, Any] | None = None) -> State:
        """`state` with this loader's position in `state.data[key]` (save that state to resume here);
        `position`: an earlier `state_dict()` of it instead (a consumer that reads ahead)."""
        if not isinstance(state.data, dict):
            raise ConfigError(f"fz.data: state.data is a {type(state.data).__name__}; the loader keeps its "
                              f"position in a dict entry ({self.key!r})")
        return state.replace(data={**state.data, self.key: position or self.state_dict()})

    def seek(self, epoch: int, index: int = 0) -> None:
        """The next iteration starts at sample `index` of `epoch` (the position a run skipping the rest
        of an epoch goes on from)."""
        if epoch < 0 or index < 0:
            raise ConfigError(f"fz.data: seek({epoch}, {index}): the epoch and the index are >= 0")
        self._pos = (int(epoch), int(index))

    def __iter__(self) -> Iterator[Any]:
        """Batches from the current position on; the position advances as each one is handed out."""
        epoch, index = self._pos
        g = torch.Generator().manual_seed(module_seed(self.seed, f"fz.data/workers/{epoch}/{index}/{self.layout.rank}"))
        steps = Steps(self.dataset, self.layout, self.collate_fn, self._pos, self.epochs, self.seed, self.shuffle,
                      self.iterable, self.order)
        with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            loader = StatefulDataLoader(steps, batch_size=None, num_workers=self.num_workers, collate_fn=unchanged,
                                        generator=g)
        for pos, batch in loader:
            self._pos = pos
            yield batch

    def __repr__(self) -> str:
        return (f"fz.data.Loader(rows={self.layout.rows}, world={self.layout.world}, epoch={self._pos[0]}, "
                f"index={self._pos[1]}, workers={self.num_workers})")

    def _check(self, saved: Any) -> tuple:
        if not isinstance(saved, dict) or type(saved.get("format")) is not int or saved["format"] != FORMAT:
            raise ConfigError(f"fz.data: state.data[{self.key!r}] is not a position fz.data wrote: {saved!r:.80}")
        missing = [k for k in ("seed", "shuffle", "size", "epoch", "index") if k not in saved]
        if missing:
            raise ConfigError(f"fz.data: the saved position state.data[{self.key!r}] has no {', '.join(missing)}: "
                              "damaged, or not what fz.data wrote")
        for name in ("seed", "shuffle", "size"):  # numbers or null as JSON holds them (a tensor has no one truth)
            if not isinstance(saved[name], (int, type(None))):
                raise ConfigError(f"fz.data: the saved position state.data[{self.key!r}] has "
                                  f"{name}={saved[name]!r:.60}, not a number: damaged, or not what fz.data wrote")
            if saved[name] != getattr(self, name):
                raise ConfigError(f"fz.data: the saved position has {name}={saved[name]!r}, this loader "
                                  f"{getattr(self, name)!r}: a different data order. Pass the same {name}, "
                                  "or restart=True to read from the start")
        epoch, index = saved["epoch"], saved["index"]
        top = self.size if self.size is not None else 2**62
        if type(epoch) is not int or type(index) is not int or epoch < 0 or not 0 <= index <= top:
            raise ConfigError(f"fz.data: the saved position state.data[{self.key!r}] is epoch {epoch!r:.40}, index "
                              f"{index!r:.40}: not an epoch >= 0 and a sample index from 0 to {top}; damaged or "
                              "altered")
        return epoch, index


AHEAD = 1024  # a saved position may be this many times past this run's step's samples (a run with more ranks or
# rows per step saved it, or a consumer read ahead): a larger one is no position a run reached


def _check_reachable(index: int, step: int, global_rows: int, key: str) -> None:
    """An iterable dataset's saved sample `index` is one the state's `step` updates can have read:
    resuming reads past that many samples one by one (unbounded for an endless stream)."""
    most = (step + 1) * global_rows * AHEAD
    if index > most:
        raise ConfigError(f"fz.data: the saved position state.data[{key!r}] is at sample {index}, but the state is "
                          f"at step {step}, which reads at most {(step + 1) * global_rows} samples of "
                          f"{global_rows} a step (this position is more than {AHEAD}x that): damaged or altered. "
                          "Pass restart=True to read from the start, or loader.seek(epoch, index)")


def _is_iterable(dataset: Any) -> bool:
    if isinstance(dataset, IterableDataset):
        return True
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        return False
    if hasattr(dataset, "__iter__"):
        return True
    raise ConfigError(f"fz.data.loader needs a dataset with __getitem__ and __len__ (map-style) or __iter__ "
                      f"(iterable), got {type(dataset).__name__}")


def _ranks(of: State | Spec) -> tuple[int, int]:
    if isinstance(of, State):
        plan = of.plan
        return plan.ranks.index(plan.rank), len(plan.ranks)
    from fz.distributed import group as distributed
    return distributed.init() if not dist.is_initialized() else (dist.get_rank(), dist.get_world_size())


def loader(dataset: Any, state_or_spec: State | Spec, *, micro_batch: int | None = None,
           shuffle: bool | None = None, seed: int | None = None, num_workers: int = 0,
           collate_fn: Callable[[list[Any]], Any] | None = None, drop_last: bool | Literal["micro_batch"] = True,
           epochs: int | None = None, key: str = "loader", restart: bool = False, split: bool = False,
           order: Order | None = None) -> Loader:
    """This rank's batch for each step: `grad_accum * micro_batch` rows (the spec's grad_accum;
    `micro_batch` defaults to spec.micro_batch), epoch after epoch (`epochs=None`: forever).

    Map-style datasets are shuffled per epoch with `seed` (default spec.seed); an iterable
    dataset is read in its own order (`shuffle=True` is an error) and resumes by reading
    past the samples already used. Given a state, the loader starts at `state.data[key]`
    (written by `loader.attach(state)` and saved with it); a state past step 0 without one
    is an error unless `restart=True` (read from the start). Given a spec, it starts at the
    start. `drop_last=False` keeps an epoch's last, smaller step (split across ranks as
    evenly as possible; for evaluation: train_step needs full steps).

    `split=True` yields each step as an `fz.MicroBatches`: each micro-batch is collated on its
    own (a padding collator pads it to its own longest row) and takes the samples accelerate's
    sharded loader gives transformers' Trainer (fz/data/order.py). An epoch's last, smaller
    step (`drop_last=False`) then has as many micro-batches as its samples start, the last
    filled up with the epoch's first samples (accelerate's even_batches);
    `drop_last="micro_batch"` keeps only whole micro-batches (transformers' dataloader_drop_last).
    train_step takes such steps with any Spec.
    `order(epoch, size)`: each epoch's sample indices, instead of fz's seeded permutation.
    """
    spec = state_or_spec.spec if isinstance(state_or_spec, State) else state_or_spec
    if not isinstance(spec, Spec):
        raise ConfigError(f"fz.data.loader needs an fz.State or fz.Spec, got {type(state_or_spec).__name__}")
    micro = micro_batch if micro_batch is not None else spec.micro_batch
    if not isinstance(micro, int) or micro < 1:
        raise ConfigError(f"fz.data.loader: micro_batch={micro!r}; pass micro_batch=... (or set Spec.micro_batch)")
    if spec.micro_batch is not None and micro != spec.micro_batch:
        raise ConfigError(f"fz.data.loader: micro_batch={micro} but Spec.micro_batch={spec.micro_batch}")
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ConfigError(f"fz.data.loader: num_workers={num_workers!r} must be an integer >= 0")
    if drop_last == "micro_batch" and not split:
        raise ConfigError('fz.data.loader: drop_last="micro_batch" needs split=True (micro-batches of their own)')
    if drop_last not in (True, False, "micro_batch"):
        raise ConfigError(f'fz.data.loader: drop_last={drop_last!r}; use True, False or "micro_batch"')
    rank, world = _ranks(state_or_spec)
    layout = Layout(spec.grad_accum * micro, world, rank, drop_last, micro if split else None)
    iterable = _is_iterable(dataset)
    if iterable and shuffle:
        raise ConfigError("fz.data.loader: an iterable dataset is read in its own order; shuffle it in the dataset "
                          "(shuffle=True needs a map-style dataset)")
    position = None
    if isinstance(state_or_spec, State) and not restart:
        data = state_or_spec.data
        position = data.get(key) if isinstance(data, dict) else None
        if position is None and int(state_or_spec.step) > 0:
            raise ConfigError(f"fz.data.loader: the state is at step {int(state_or_spec.step)} but state.data has no "
                              f"position {key!r} (save `loader.attach(state)` to resume the data exactly); "
                              "pass restart=True to read from the start")
    out = Loader(
        dataset,
        layout,
        seed=spec.seed if seed is None else seed,
        shuffle=not iterable and shuffle is not False,
        num_workers=num_workers,
        collate_fn=collate_fn or default_collate,
        epochs=epochs,
        key=key,
        position=position,
        order=order,
    )
    if position is not None and out.size is None and isinstance(state_or_spec, State):  # read past, one by one
        _check_reachable(out.state_dict()["index"], int(state_or_spec.step), layout.global_rows, key)
    if out.size is not None:
        if not out.steps_per_epoch:
            raise ConfigError(f"fz.data.loader: {out.size} samples make no step of {layout.global_rows} "
                              f"({world} ranks x {layout.rows} rows)")
        rest = out.size % layout.global_rows
        if drop_last is False and not split and 0 < rest < world:
            raise ConfigError(f"fz.data.loader: an epoch's last step would have {rest} samples for {world} ranks; "
                              "use drop_last=True (or split=True: micro-batches filled up as accelerate fills them)")
    return out
