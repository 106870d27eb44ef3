"""The script's own model kept in step with the engine's State, as DeepSpeed's engine keeps it.

DeepSpeed trains the module it is given in place, so a script reads its trained weights through
its own `model` (`model.eval(); model(x)`, `torch.save(model.state_dict())`) and loads weights
into it after `initialize` (`engine.module.load_state_dict(sd)`), which training then starts
from. fz's weights live in the State, so hooks on the model do what DeepSpeed's sharing does:
before the model's forward or state_dict, the State's weights are copied in (once per update;
at stage 3 gathered, every rank calling, as DeepSpeed's stage-3 forward gathers); after its
load_state_dict, the loaded weights go into the State (fz.load_weights, optimizer state kept).
The hooks are plain functions holding the engine weakly: a copy of the model does not copy it.
"""
from __future__ import annotations

import os
import tempfile
import weakref
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

import fz
from fz.errors import ConfigError
from fz.observe.full_params import copy_full_params


def pull(engine: Any) -> None:
    """The State's current weights into the engine's model (nothing if it holds them already)."""
    if engine._synced_step == engine.global_steps or engine._step is not None or engine._syncing:
        return
    engine._syncing = True
    try:
        copy_full_params(engine.state, engine._model)  # one bucket gathered at a time
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


def watch(engine: Any, model: nn.Module) -> list[Any]:
    """Hooks on `model` that pull before its forward and state_dict and push after load_state_dict."""
    ref = weakref.ref(engine)

    def before_forward(module: nn.Module, args: Any) -> None:
        if (e := ref()) is not None:
            pull(e)

    def before_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if (e := ref()) is not None:
            pull(e)

    def after_load(module: nn.Module, incompatible: Any) -> None:
        if (e := ref()) is not None:
            push(e)

    return [model.register_forward_pre_hook(before_forward), model.register_state_dict_pre_hook(before_state_dict),
            model.register_load_state_dict_post_hook(after_load)]
