"""A user's torch optimizer and lr scheduler (`deepspeed.initialize(optimizer=, lr_scheduler=)`,
a Hugging Face `Trainer(optimizers=(...))`) in fz.optim.

DeepSpeed and the Trainer step the user's own `torch.optim` object. fz's optimizer is a pure transformation
over sharded state, so the client's optimizer is read, not run: its class and hyperparameters
become the fz.optim alias that computes the same update (AdamW, Adam, SGD), and its parameter
groups become a weight-decay mask (the usual "no decay for biases and norms" groups). A
setting fz cannot honour (per-group learning rates, amsgrad, ...) is a ConfigError naming it.

A client's lr scheduler (any `torch.optim.lr_scheduler` object) becomes the lr schedule
`lr(count)`: a private copy of it, bound to a stand-in optimizer, is stepped as far as a count
asks (each value computed once), so every scheduler torch has gives exactly its own lrs.
"""
from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fz import optim
from fz.errors import ConfigError
from fz.optim.base import GradientTransformation

_KINDS = {"AdamW": "adamw", "Adam": "adam", "SGD": "sgd", "FusedAdam": "adam", "DeepSpeedCPUAdam": "adam"}
_SAME = ("lr", "betas", "eps", "momentum", "nesterov", "dampening", "bias_correction")
_OFF = ("amsgrad", "maximize", "differentiable")


@dataclass(frozen=True)
class ClientOptimizer:
    """The fz optimizer a client's torch optimizer computes, as a function of the lr (a number or a
    schedule): Spec.from_deepspeed's `optimizer=` keyword."""

    kind: str  # adamw | adam | sgd
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decay: frozenset[str] | None = None  # the parameters weight decay applies to; None: all
    momentum: float = 0.0
    nesterov: bool = False
    groups: int = 1
    members: tuple[tuple[str, ...], ...] = ()  # each group's parameter names, in its order (DeepSpeed's param_shapes)
    bias_correction: bool = True  # DeepSpeed's FusedAdam and DeepSpeedCPUAdam take False (a group key of theirs)

    def __call__(self, lr: Any) -> GradientTransformation:
        wd, names = self.weight_decay, self.decay
        if not wd or names is None:
            if self.kind == "adamw":
                return optim.adamw(lr=lr, betas=self.betas, eps=self.eps, weight_decay=wd,
                                   bias_correction=self.bias_correction)
            if self.kind == "adam":
                return optim.adam(lr=lr, betas=self.betas, eps=self.eps, weight_decay=wd,
                                  bias_correction=self.bias_correction)
            return optim.sgd(lr=lr, momentum=self.momentum, nesterov=self.nesterov, weight_decay=wd)
        decay = optim.masked(optim.add_decayed_weights(wd), names)
        adam = optim.scale_by_adam(*self.betas, self.eps, self.bias_correction)
        if self.kind == "adamw":
            return optim.chain(adam, decay, optim.scale_by_learning_rate(lr, wd))
        if self.kind == "adam":
            return optim.chain(decay, adam, optim.scale_by_learning_rate(lr))
        parts = [decay] + ([optim.trace(self.momentum, self.nesterov)] if self.momentum else [])
        return optim.chain(*parts, optim.scale_by_learning_rate(lr, wd))

    def __repr__(self) -> str:
        where = "" if self.decay is None or not self.weight_decay else f" on {len(self.decay)} parameters"
        return f"the client's torch optimizer: fz.optim.{self.kind}(weight_decay={self.weight_decay}{where})"


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


DEEPSPEED = ("deepspeed.initialize(optimizer=...)", "give the config an optimizer section")


def client_optimizer(opt: Any, model: nn.Module, where: tuple[str, str] = DEEPSPEED) -> ClientOptimizer:
    """`opt` (a torch optimizer over `model`'s parameters) as the fz optimizer with its update.
    `where`: (the call that gave it, the other way to choose an optimizer there), for errors."""
    call, other = where
    kind = _KINDS.get(type(opt).__name__)
    if kind is None or not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError(f"{call}: fz reads torch's {', '.join(sorted(_KINDS))} "
                          f"(their hyperparameters become an fz.optim optimizer), not {type(opt).__name__}; "
                          f"or {other}")
    # torch's Adam says it in its defaults; DeepSpeed's FusedAdam and DeepSpeedCPUAdam keep it as an attribute
    # (AdamW by default): read there too, or a script's real DeepSpeed class trained as Adam with L2 decay
    if kind == "adam" and (opt.defaults.get("decoupled_weight_decay") or opt.defaults.get("adam_w_mode")
                           or getattr(opt, "adam_w_mode", False)):
        kind = "adamw"
    groups = opt.param_groups
    first = groups[0]
    for g in groups:
        for key in _SAME:
            if g.get(key) != first.get(key):
                raise ConfigError(f"{call}: its parameter groups have different {key} "
                                  f"({first.get(key)!r} and {g.get(key)!r}); fz applies one {key} to every "
                                  "parameter (groups may differ only in weight_decay, which becomes a mask)")
        for key in _OFF:
            if g.get(key):
                raise ConfigError(f"{call}: {key}=True is not supported by fz")
        if kind == "sgd" and g.get("dampening"):
            raise ConfigError(f"{call}: SGD's dampening must be 0 in fz")
    decays = {float(g.get("weight_decay", 0.0)) for g in groups} - {0.0}
    if len(decays) > 1:
        raise ConfigError(f"{call}: its groups use weight_decay {sorted(decays)}; fz "
                          "applies one weight decay (and 0 to a group without it)")
    wd = decays.pop() if decays else 0.0
    names = _names(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    grouped = {names[id(p)]: float(g.get("weight_decay", 0.0)) for g in groups for p in g["params"] if id(p) in names}
    missing = sorted(trainable - set(grouped))
    if missing:
        raise ConfigError(f"{call}: {len(missing)} trainable parameters are in no "
                          f"group of the optimizer ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); "
                          "put them in a group, or set requires_grad=False to freeze them")
    decay = frozenset(n for n, d in grouped.items() if d)
    members = tuple(tuple(names[id(p)] for p in g["params"] if id(p) in names) for g in groups)
    return ClientOptimizer(kind, float(first["lr"]), tuple(first.get("betas", (0.9, 0.999))),
                           float(first.get("eps", 1e-8)), wd, None if decay >= trainable else decay,
                           float(first.get("momentum", 0.0) or 0.0), bool(first.get("nesterov", False)), len(groups),
                           members, bool(first.get("bias_correction", True)))


def parameter_groups(model_parameters: Iterable[Any] | None, model: nn.Module, lr: float) -> Any:
    """`model_parameters` as a stand-in torch AdamW (for reading its groups), or None if it is the
    model's parameters in one group."""
    if model_parameters is None:
        return None
    items = list(model_parameters)
    if not items or not isinstance(items[0], dict):
        return None
    return torch.optim.AdamW(items, lr=lr)


class TorchSchedule:
    """A torch lr scheduler as fz's `lr(count)`: the lr its optimizer's first group has after
    `count` scheduler steps (DeepSpeed steps it once after each optimizer step)."""

    def __init__(self, scheduler: Any, call: str = "deepspeed.initialize(lr_scheduler=...)"):
        opt = getattr(scheduler, "optimizer", None)
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"{call}: {type(scheduler).__name__} has no torch "
                              "optimizer; give a torch.optim.lr_scheduler object (or a callable of the optimizer)")
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ConfigError(f"{call}: ReduceLROnPlateau steps on an evaluation's metric; fz's lr is a function "
                              "of the step count. Use a schedule of the step")
        stand_in = torch.optim.SGD([{**{k: v for k, v in g.items() if k != "params"},
                                     "params": [torch.zeros(1, requires_grad=True)]} for g in opt.param_groups])
        self.shadow = copy.deepcopy(scheduler, memo={id(opt): stand_in})
        self.opt = stand_in
        self.lrs = [float(stand_in.param_groups[0]["lr"])]

    def __call__(self, count: int) -> float:
        while len(self.lrs) <= count:
            with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": it never steps one
                warnings.simplefilter("ignore")
                self.shadow.step()
            self.lrs.append(float(self.opt.param_groups[0]["lr"]))
        return self.lrs[count]

    def __repr__(self) -> str:
        return f"the client's {type(self.shadow).__name__}"


def client_schedule(lr_scheduler: Any, torch_optimizer: Any,
                    call: str = "deepspeed.initialize(lr_scheduler=...)") -> Callable[[int], float]:
    """The schedule of the client's lr_scheduler: an object, or a callable DeepSpeed calls with the
    optimizer (`torch_optimizer`: the client's, or a stand-in with the config's lr). `call` names
    what gave it, for errors."""
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        if torch_optimizer is None:
            raise ConfigError("deepspeed.initialize(lr_scheduler=callable): fz calls it with a torch optimizer, so it "
                              "needs optimizer= (a torch optimizer) or an optimizer section")
        lr_scheduler = lr_scheduler(torch_optimizer)
    if getattr(lr_scheduler, "cycle_momentum", False):  # OneCycleLR, CyclicLR: a momentum / beta1 schedule too
        raise ConfigError(f"{call}: {type(lr_scheduler).__name__}(cycle_momentum=True): fz "
                          "follows a client scheduler's lr only, so its momentum cycle would not reach the update; "
                          "pass cycle_momentum=False, or use a DeepSpeed config's OneCycle scheduler")
    return TorchSchedule(lr_scheduler, call)
