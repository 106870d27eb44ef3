"""The optimizer and lr scheduler `deepspeed.initialize` returns: read-only views of the engine's state.

fz's optimizer is a pure transformation inside `engine.state`, stepped by `engine.step()`, as
DeepSpeed's engine steps its optimizer and scheduler itself. Scripts read these objects (the
lr for logging, the loss scale); they never step them, and a call that would is a clear error
or does nothing, as DeepSpeed's engine makes it.
"""
from __future__ import annotations

from typing import Any, Protocol

from fz.errors import ConfigError


class Engine(Protocol):
    """What the views read of fz/deepspeed/engine.py's engine, which makes them (a Protocol, so
    neither file imports the other back)."""

    @property
    def loss_scale(self) -> float: ...
    def get_lr(self) -> list[float]: ...
    def _lr_count(self) -> int: ...


class EngineOptimizer:
    """`optimizer` from initialize: `param_groups[i]["lr"]` is the next update's lr."""

    def __init__(self, engine: Engine, groups: int):
        self._engine, self.groups = engine, groups

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [{"lr": lr} for lr in self._engine.get_lr()]

    @property
    def loss_scale(self) -> float:
        return self._engine.loss_scale

    cur_scale = loss_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: gradients live only inside a step."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigError("the optimizer deepspeed.initialize returns is stepped by engine.step(); call that")

    def state_dict(self) -> dict[str, Any]:
        raise ConfigError("the optimizer's state is in engine.state.opt_state; engine.save_checkpoint saves it")


class EngineSchedule:
    """`lr_scheduler` from initialize: its lr follows the engine's updates."""

    def __init__(self, engine: Engine):
        self._engine = engine

    def get_last_lr(self) -> list[float]:
        return self._engine.get_lr()

    get_lr = get_last_lr

    @property
    def last_batch_iteration(self) -> int:
        return self._engine._lr_count() - 1

    last_epoch = last_batch_iteration

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: engine.step() steps the schedule with each update (as DeepSpeed's engine does)."""

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}
