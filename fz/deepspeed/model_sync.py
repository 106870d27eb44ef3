"""The script's own model kept in step with the engine's State, as DeepSpeed's engine keeps it.

DeepSpeed trains the module it is given in place, so a script reads its trained weights through
its own `model` (`model.eval(); model(x)`, `torch.save(model.state_dict())`) and loads weights
into it after `initialize` (`engine.module.load_state_dict(sd)`), which training then starts
from. fz's weights live in the State, so hooks on the model do what DeepSpeed's sharing does:
before the model's forward or state_dict, the State's weights are copied in (once per update;
at stage 3 gathered, every rank calling, as DeepSpeed's stage-3 forward gathers); after its
load_state_dict, the loaded weights go into the State (fz.load_weights, optimizer state kept).
At ZeRO 0-2 `model.parameters()` reads them too. The hooks hold the engine weakly: a copy of the
model does not copy it.
"""
from __future__ import annotations

import copy
import os
import tempfile
import weakref
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

import fz
from fz.errors import ConfigError
from fz.observe.full_params import copy_full_params, copy_local_params


def pull(engine: Any) -> None:
    """The State's current weights into the engine's model (nothing if it holds them already)."""
    if engine._synced_step == engine.global_steps or engine._step is not None or engine._syncing:
        return
    engine._syncing = True
    try:
        if copy_local_params(engine.state, engine._model) is None:  # ZeRO 0-2: local, as DeepSpeed's module is
            copy_full_params(engine.state, engine._model)  # stage 3: one bucket gathered at a time, every rank
        engine._synced_step = engine.global_steps
    finally:
        engine._syncing = False


def push(engine: Any) -> None:
    """The model's weights (just loaded into it) into the State, its optimizer state kept."""
    if engine._syncing:
        return
    if engine._step is not None:
        raise ConfigError("load_state_dict into the engine's model inside an accumulation window: load before "
                          "engine(batch), or after engine.step()")
    if engine.zero_optimization_stage() == 3:
        raise ConfigError("load_state_dict into the engine's model at ZeRO stage 3: its parameters are the State's "
                          "shards; load the weights before deepspeed.initialize, or with fz.load_weights(engine.state, "
                          "path) / engine.load_checkpoint")
    engine._syncing = True
    try:
        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in engine._model.state_dict().items()
                   if isinstance(v, torch.Tensor)}
        with tempfile.TemporaryDirectory(prefix="fz-loaded-") as tmp:
            path = os.path.join(tmp, "model.safetensors")
            save_file(tensors, path)
            engine.state = fz.load_weights(engine.state, path, strict=False)
        engine._synced_step = engine.global_steps
    finally:
        engine._syncing = False


def show_grads(engine: Any) -> None:
    """After a backward, the open step's gradients as the script's parameters' `.grad`, where this
    rank holds them whole, as DeepSpeed's ZeRO 0-1 leaves them: this rank's own sum before the
    boundary, the average over ranks after the boundary's backward at ZeRO 0 (ZeRO-1's is reduced
    into shards: None, as DeepSpeed's). Views of the step's buffers, no copy; a parameter whose
    dtype is not the gradient's (a bf16/fp16 run's fp32 model) gets none: deepspeed.utils.
    safe_get_full_grad reads it."""
    grads = engine._step.local_grads() if engine._step is not None else {}
    aliases = engine.state.skeleton.aliases
    shown = []
    for name, p in nn.Module.named_parameters(engine._model, remove_duplicate=False):
        g = grads.get(aliases.get(name, name))
        if g is not None and g.dtype == p.dtype and g.device == p.device and g.shape == p.shape:
            p.grad = g
            shown.append(p)
    engine._shown_grads = shown


def drop_grads(engine: Any) -> None:
    """The gradients `show_grads` set taken off (before the next backward accumulates into the
    buffers they view, and after the update, as DeepSpeed's zero_grad leaves None)."""
    for p in engine._shown_grads:
        p.grad = None
    engine._shown_grads = []


class _Sync:
    """A hook on the script's model, holding the engine weakly. A copy of the model (deepcopy,
    pickle: `torch.save(model)`, which DeepSpeed's ZeRO 0-2 module allows) gets one holding none:
    it is the model's, not the engine's."""

    def __init__(self, kind: str, engine: Any = None):
        self.kind, self.engine = kind, weakref.ref(engine) if engine is not None else None

    def __call__(self, module: nn.Module, *args: Any) -> None:
        e = self.engine() if self.engine is not None else None
        if e is not None:
            push(e) if self.kind == "load" else pull(e)

    def __reduce__(self) -> tuple[Any, ...]:
        return _Sync, (self.kind,)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Sync:
        return _Sync(self.kind)


class _Reading:
    """`module.named_parameters` (and so `parameters()`), reading the State's weights first at ZeRO
    0-2, where DeepSpeed's module parameters are the trained ones between updates (an EMA over
    `model.parameters()` reads them). Not at stage 3: DeepSpeed's are partitioned there, and a read
    must not start a collective."""

    def __init__(self, module: nn.Module, engine: Any = None):
        self.module = weakref.ref(module)  # the module holds this: no cycle keeps it alive
        self.engine = weakref.ref(engine) if engine is not None else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        e = self.engine() if self.engine is not None else None
        if e is not None:
            pull(e)
        module = self._own()
        return type(module).named_parameters(module, *args, **kwargs)

    def _own(self) -> nn.Module:
        module = self.module()
        if module is None:  # only its module holds it: called, it is alive
            raise RuntimeError("fz.deepspeed: a parameter reader outlived its module")
        return module

    def __reduce__(self) -> tuple[Any, ...]:
        return _Reading, (self._own(),)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Reading:
        return _Reading(copy.deepcopy(self._own(), memo))


def watch(engine: Any, model: nn.Module) -> list[Any]:
    """Hooks on `model` that pull before its forward and state_dict and push after load_state_dict;
    at ZeRO 0-2 its modules' `named_parameters` pull too (`unwatch` takes them away)."""
    handles = [model.register_forward_pre_hook(_Sync("forward", engine)),
               model.register_state_dict_pre_hook(_Sync("state_dict", engine)),
               model.register_load_state_dict_post_hook(_Sync("load", engine))]
    if engine.zero_optimization_stage() < 3:
        for module in model.modules():
            module.__dict__["named_parameters"] = _Reading(module, engine)
    return handles


def unwatch(model: nn.Module, handles: list[Any]) -> None:
    """The hooks and readers `watch` put on `model` taken away."""
    for handle in handles:
        handle.remove()
    for module in model.modules():
        if isinstance(module.__dict__.get("named_parameters"), _Reading):
            del module.__dict__["named_parameters"]
