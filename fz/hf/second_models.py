"""Models a Trainer holds besides the one it trains (TRL's `ref_model`, a `reward_model`, a
`teacher_model`): each becomes an inference-only fz State, sharded as the trained one is.

DeepSpeed under TRL shards a reference model with ZeRO-3 when the policy trains with ZeRO-3
(and keeps it whole otherwise); fz does the same: the second model's parameters are frozen
and held by an fz State of the policy's stage (3, or 0), precision and parameter tier, with no
gradients and no optimizer state. The trainer's attribute then holds a `OnFzModel` in the
model's place: calling it runs `fz.apply` on that State (at stage 3 every rank takes part, as
every rank runs the trainer's loss); its other attributes (`config`, ...) are the model's own,
whose own weights are let go (moved to the meta device) once the State holds them.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn

import fz
from fz.hf.redirection import RunsRedirected

log = logging.getLogger(__name__)


class OnFzModel(RunsRedirected):
    """A frozen model's stand-in: forward is fz.apply on its State, in eval mode.

    A function put in its `forward`'s place (TRL's forward redirection: the distillation teacher's
    backbone runs so; fz/hf/redirection.py) runs as the forward does; the root's own tensors it ran
    with (embeddings, LM head: TRL reads the teacher's head after the call) are then kept in
    `wrapped`, copies, until the next such call."""

    state: fz.State
    wrapped: nn.Module

    def __init__(self, state: fz.State, wrapped: nn.Module):
        super().__init__()
        object.__setattr__(self, "state", state)  # neither is a submodule: the State holds the weights
        object.__setattr__(self, "wrapped", wrapped)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return fz.apply(self.state, *args, **kwargs)

    def _redirect_state(self) -> fz.State:
        return self.state

    def _redirect_train(self) -> bool:
        return False  # as its forward: the model is frozen

    def _after_redirected(self, state: fz.State) -> None:
        _keep_root_tensors(state, self.wrapped)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inside = self._inside()
            return getattr(inside if inside is not None else object.__getattribute__(self, "wrapped"), name)


def _keep_root_tensors(state: fz.State, wrapped: nn.Module) -> None:
    """The root's parameters (and root leaves', fz/model/leaves.py) as bound in the running call,
    copied into `wrapped`'s meta parameters' places (tied names share one copy)."""
    skel = state.skeleton
    copies: dict[str, torch.Tensor] = {}
    for name, canonical in skel.aliases.items():
        unit = skel.param_unit.get(canonical)
        if unit is None or not (unit == 0 or skel.units[unit].leaf):
            continue  # a buffer, or a block's (gathered only while the block runs)
        if canonical not in copies:
            value: Any = functools.reduce(getattr, canonical.split("."), skel.root)
            copies[canonical] = value.detach().clone()
        owner, _, leaf = name.rpartition(".")
        module = wrapped.get_submodule(owner)
        module._parameters[leaf] = nn.Parameter(copies[canonical], requires_grad=False)


def second_models(trainer: Any, policy: nn.Module) -> list[str]:
    """The names of `trainer`'s attributes holding another model with parameters, sorted (every
    rank makes their States in the same order)."""
    own = {id(p) for p in policy.parameters()}
    names = []
    for name, value in sorted(vars(trainer).items()):
        if name in ("model", "model_wrapped") or not isinstance(value, nn.Module) or isinstance(value, OnFzModel):
            continue
        params = list(value.parameters())
        if params and not any(id(p) in own for p in params):
            names.append(name)
    return names


def shard_second_models(trainer: Any, policy: nn.Module, spec: fz.Spec) -> None:
    """Each second model of `trainer` (second_models) as an inference-only State, in its place."""
    offload = spec.offload if spec.offload is not None and spec.offload.params != "device" else None
    frozen = fz.Spec(stage=3 if spec.stage == 3 else 0, precision=spec.precision, offload=offload,
                     shard_group_size=spec.shard_group_size, timeout_s=spec.timeout_s, seed=spec.seed,
                     wrap=spec.wrap)
    for name in second_models(trainer, policy):
        model = getattr(trainer, name)
        model.requires_grad_(False)
        own = {p.dtype for p in model.parameters() if p.is_floating_point()}
        half = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(own.pop()) if len(own) == 1 else None
        # a bf16 (fp16) one computes in its dtype, as DeepSpeed runs it; its values kept in fp32
        state = fz.init(model.float(), frozen.replace(precision=half) if half else frozen)
        model.to("meta")  # the State holds the weights now: the whole copy is let go (its attributes stay)
        setattr(trainer, name, OnFzModel(state, model))
        log.info("fz.hf: trainer.%s runs on an inference-only fz State (ZeRO stage %d, %s, no gradients or "
                 "optimizer state)", name, frozen.stage, state.spec.precision)
