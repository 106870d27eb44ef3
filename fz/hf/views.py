"""`trainer.optimizer` and `trainer.lr_scheduler` of fz.hf.Trainer: read-only views of the State.

transformers hands its optimizer and scheduler to every callback (`kwargs["lr_scheduler"]
.get_last_lr()`, `kwargs["optimizer"].param_groups[0]["lr"]` are common lines). fz's optimizer
is a pure transformation inside `trainer.fz_state`, so these views read it: the lr the next
update will use, as transformers' scheduler gives it once it has stepped. Stepping them, or
setting an lr by hand, would not reach fz's update: an error, not a silent no-op.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import fz
from fz.errors import ConfigError
from fz.hf.plateau import Plateau
from fz.optim.base import lr_at


def schedule_of(state: fz.State) -> Any:
    """The lr schedule the State's Spec was made with (from the arguments or a DeepSpeed config), or None."""
    prov = state.spec.provenance
    schedule: Any = None
    if prov is not None:
        schedule = prov.objects.get("lr")
        if schedule is None and "scheduler" in prov:
            schedule = prov["scheduler"][0]
    return schedule


def next_lr(state: fz.State) -> float:
    """The lr of `state`'s next update: its schedule at the updates applied so far (skipped ones
    do not step it, as transformers' scheduler skips them), else the last one applied."""
    schedule = schedule_of(state)
    if not callable(schedule) and not isinstance(schedule, int | float):
        return fz.optim.current_lr(state)
    skipped = int(state.scaler["skipped"]) if state.scaler and "skipped" in state.scaler else 0
    return lr_at(schedule, int(state.step) - skipped)


def logged_lr(state: fz.State) -> float | None:
    """The lr transformers logs for the update just made: that update's own (the Trainer reads it
    before stepping its scheduler), or, with a DeepSpeed config's optimizer or scheduler section,
    the next update's, as under DeepSpeed, whose engine has stepped the schedule by then."""
    lr = state.metrics.get("lr")
    if lr is None:
        return None
    keys = state.spec.provenance.ds_keys if state.spec.provenance is not None else {}
    sections = keys.get("optimizer") == "optimizer" or keys.get("scheduler") == "scheduler"
    return next_lr(state) if sections else float(lr)


class _Group(dict):
    def __setitem__(self, key: Any, value: Any) -> None:
        raise ConfigError(f"trainer.optimizer.param_groups[i][{key!r}] = ...: fz's lr comes from the arguments' "
                          "schedule (lr_scheduler_type) or the DeepSpeed config's \"scheduler\"; setting it by hand "
                          "does not reach fz's update")


class TrainerOptimizer:
    """What callbacks read of transformers' optimizer: `param_groups` (the decay and no-decay groups,
    each with the next update's lr)."""

    def __init__(self, lr: Callable[[], float]):
        self._lr = lr

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [_Group({"lr": self._lr()}), _Group({"lr": self._lr()})]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: gradients live only inside a step."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigError("trainer.optimizer.step(): fz.train_step updates the State in the Trainer's loop")

    def state_dict(self) -> dict[str, Any]:
        raise ConfigError("the optimizer's state is in trainer.fz_state.opt_state; checkpoints save it")


class TrainerSchedule:
    """What callbacks read of transformers' scheduler: `get_last_lr()` (the next update's lr) and
    `last_epoch` (the updates applied)."""

    def __init__(self, lr: Callable[[], float], count: Callable[[], int]):
        self._lr, self._count = lr, count

    def get_last_lr(self) -> list[float]:
        return [self._lr(), self._lr()]

    @property
    def last_epoch(self) -> int:
        return self._count()

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigError("trainer.lr_scheduler.step(): the schedule follows the State's updates in the Trainer's "
                          "loop; a second step would not reach fz's update")

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch}


class PlateauView(TrainerSchedule, torch.optim.lr_scheduler.ReduceLROnPlateau):  # type: ignore[misc, override]
    """`trainer.lr_scheduler` of reduce_lr_on_plateau: a ReduceLROnPlateau to transformers, whose
    `_evaluate` steps it with the evaluation's metric, as its own (fz/hf/plateau.py)."""

    def __init__(self, lr: Callable[[], float], count: Callable[[], int], schedule: Plateau):
        TrainerSchedule.__init__(self, lr, count)
        self._schedule = schedule

    def step(self, metrics: Any = None, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        if metrics is None:
            super().step()  # fz's error: an update's step is not the plateau's
        self._schedule.step(float(metrics))


def schedule_view(state: fz.State, lr: Callable[[], float], count: Callable[[], int]) -> TrainerSchedule:
    """`trainer.lr_scheduler` for `state`: a PlateauView for reduce_lr_on_plateau, else a TrainerSchedule."""
    schedule = schedule_of(state)
    return PlateauView(lr, count, schedule) if isinstance(schedule, Plateau) else TrainerSchedule(lr, count)
