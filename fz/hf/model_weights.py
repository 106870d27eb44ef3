"""`trainer.model`'s weights: let go while train() runs, filled in from the State.

fz trains a skeleton of the model whose tensors are the State's. `trainer.model`'s own
parameters would stay a second whole copy on every rank (at ZeRO-3 more than the rank's share of
the State itself), and a stale one: training never updates them. So while train() runs, each
parameter of `trainer.model` (a frozen PEFT base too) is let go: it keeps its identity, shape,
dtype, attributes and ties, on the meta device, and its storage is freed; a call of the model
runs on the State meanwhile (fz/hf/model_calls.py). The whole weights come back from the State,
one bucket gathered at a time, when they are read: at the end of train(), on the trainer's device
(where transformers places the model; at ZeRO-3 where the model was: a model larger than one
device is never whole on one), and around an online trainer's generation, on the trainer's
device (fz/hf/online.py). Every rank calls `fill` (at ZeRO-3 it gathers).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

import fz
from fz.errors import ConfigError
from fz.observe.full_params import copy_full_params

log = logging.getLogger(__name__)
Released = dict[str, torch.device]  # the parameters let go, by name, and the device each comes back on


def _swap(p: nn.Parameter, device: torch.device | str) -> None:
    """`p` itself (its identity, attributes and ties kept) on `device`: meta frees it, another
    device gives it new, unset storage."""
    other = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
    other.__dict__.update(p.__dict__)
    torch.utils.swap_tensors(p, other)


def let_go(model: nn.Module, device: torch.device | None) -> Released:
    """Each parameter's storage freed (the parameter kept, on the meta device), to come back on
    `device` (None: the device it was on)."""
    out: Released = {}
    for name, p in model.named_parameters():  # a tied parameter once
        if p.is_meta:
            continue
        p_device = p.device
        try:
            _swap(p, "meta")
        except RuntimeError as e:  # something holds on to it (an autograd graph kept alive)
            log.warning("fz.hf: trainer.model keeps its own copy of %s (%s): it cannot be let go while train() "
                        "runs", name, e)
            continue
        out[name] = device if device is not None else p_device
    return out


def fill(model: nn.Module, state: fz.State, released: Released) -> None:
    """The State's weights in `model` (in its dtype), the parameters let go given storage again on
    their devices first, and its buffers moved there; if the copy fails they are let go again. A
    collective: every rank calls it."""
    own = dict(model.named_parameters())
    given = [n for n in released if own[n].is_meta]
    for name in given:
        _swap(own[name], released[name])
    try:
        done = copy_full_params(state, model)
    except BaseException:
        for name in given:  # let go again: never storage that holds no weights
            _swap(own[name], "meta")
        raise
    missing = [n for n in released if id(own[n]) not in done]
    if missing:
        raise ConfigError(f"fz.hf: the State holds no values for trainer.model's {missing[:5]}: they cannot be "
                          "filled in after training")
    for device in set(released.values()):  # one: the trainer's device, or where the model was
        model.to(device)


def fill_after_error(fill_in: Callable[[], None]) -> None:
    """train() raised while the State held `trainer.model`'s weights: `fill_in` puts them back
    where that still works (every rank raised and gathers; one rank holds them all); where it does
    not (a rank still in a step cannot join the gather) the model stays on meta, and the warning
    says where the weights are. The train() error is what is raised either way."""
    try:
        fill_in()
    except Exception as e:  # noqa: BLE001 - the train() error is the one raised
        log.warning("fz.hf: train() failed, and trainer.model's weights could not be filled back in from "
                    "trainer.fz_state (%s: %s): its parameters stay on the meta device. trainer.fz_state holds the "
                    "weights as of the failure: fz.save(trainer.fz_state, dir) on every rank keeps them",
                    type(e).__name__, str(e)[:300])
