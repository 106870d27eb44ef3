"""The optimizer and lr scheduler `deepspeed.initialize` returns: read-only views of the engine's state.

fz's optimizer is a pure transformation inside `engine.state`, stepped by `engine.step()`, as
DeepSpeed's engine steps its optimizer and scheduler itself. Scripts read these objects (the
lr for logging, the loss scale); a call that would step them, or set an lr by hand, is a
clear error rather than a silent no-op.
"""
from __future__ import annotations

from typing import Any, Protocol

from fz.errors import ConfigError


class Engine(Protocol):
    """What the views read of fz/deepspeed/engine.py's engine, which makes them (a Protocol, so
    neither file imports the other back)."""

    @property
    def cur_scale(self) -> float: ...
    def get_lr(self) -> list[float]: ...
    def _lr_count(self) -> int: ...


class EngineOptimizer:
    """`optimizer` from initialize: `param_groups[i]["lr"]` is the next update's lr; the group's
    other settings (`betas`, `eps`, `weight_decay`, ... as DeepSpeed's optimizer holds them) are
    those fz's update applies."""

    def __init__(self, engine: Engine, groups: int, settings: list[dict[str, Any]] | None = None):
        self._engine, self.groups = engine, groups
        self._settings = settings or [{}]
        self.overflow = False  # the last update was skipped for a non-finite gradient (DeepSpeed's flag)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        own = self._settings
        return [_ReadOnlyGroup({**own[min(i, len(own) - 1)], "lr": lr}) for i, lr in enumerate(self._engine.get_lr())]

    @property
    def cur_scale(self) -> float:
        """The loss scale in use (its `loss_scale` too, as DeepSpeed's ZeRO optimizers name it)."""
        return self._engine.cur_scale

    loss_scale = cur_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: gradients live only inside a step."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigError("the optimizer deepspeed.initialize returns is stepped by engine.step(); call that")

    def state_dict(self) -> dict[str, Any]:
        raise ConfigError("the optimizer's state is in engine.state.opt_state; engine.save_checkpoint saves it")


class _ReadOnlyGroup(dict):
    """A param group as read: writing its lr would not reach fz's update (the lr is the schedule's)."""

    def __setitem__(self, key: Any, value: Any) -> None:
        raise ConfigError(f"optimizer.param_groups[i][{key!r}] = ...: fz's lr comes from the config's "
                          "\"scheduler\" (or a client lr_scheduler given to deepspeed.initialize), stepped by "
                          "engine.step(); setting it by hand is not supported")

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.__setitem__(next(iter(dict(*args, **kwargs)), "lr"), None)


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
        """engine.step() steps the schedule with each update; a script's own call would step it a
        second time in DeepSpeed (an lr fz's update would not use): refused, not ignored."""
        raise ConfigError("lr_scheduler.step(): engine.step() already steps the schedule with each update; "
                          "in DeepSpeed this call would advance it a second time, which fz does not do. "
                          "Remove the call (or give the schedule you want in the config's \"scheduler\")")

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}
