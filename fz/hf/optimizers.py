"""The optimizer and lr schedule a Hugging Face Trainer builds from TrainingArguments, in fz.optim.

`Trainer.create_optimizer` puts the parameters of `get_decay_parameter_names` (not biases, not
norm weights) in a group with `weight_decay` and the others in a group without; each fz
optimizer here applies its decay through `masked` to those names only (the names are the
model's `named_parameters()` names, which fz's optimizer states are keyed by). Without a mask
(weight_decay 0, or every parameter decays) the plain fz.optim alias runs, with its fused
kernel where it has one.

`Trainer.create_scheduler` is `transformers.get_scheduler(lr_scheduler_type, ...)`: a
LambdaLR stepped after each optimizer step, so the k-th update (k = 0, 1, ...) uses
lr * lr_lambda(k), and fz calls a schedule with the updates already applied: the same k.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fz import optim
from fz.errors import ConfigError
from fz.hf import plateau
from fz.optim import GradientTransformation
from fz.optim.base import Params, lr_at, masked, owned

# TrainingArguments.optim -> the fz optimizer that computes the same update
OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", "adamw": "adamw",
              "adafactor": "adafactor", "sgd": "sgd", "lion_32bit": "lion", "lion": "lion"}
SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup", "polynomial", plateau.KIND)
SCHEDULE_KWARGS = {"cosine": {"num_cycles"}, "polynomial": {"lr_end", "power"},  # lr_scheduler_kwargs fz reads
                   plateau.KIND: plateau.KWARGS}
SGD_ARGS = {"momentum", "nesterov", "dampening", "weight_decay"}  # optim_args the Trainer's SGD reads


def name_of(value: Any) -> str:
    """An enum of TrainingArguments (OptimizerNames, SchedulerType) as its string value."""
    return str(getattr(value, "value", value))


def parse_optim_args(text: Any) -> dict[str, str]:
    """TrainingArguments.optim_args, "k1=v1,k2=v2", as the Trainer parses it."""
    if not text:
        return {}
    out = {}
    for pair in str(text).replace(" ", "").split(","):
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"TrainingArguments.optim_args={text!r}: {pair!r} is not key=value")
        out[key] = value
    return out


def choice_errors(args: Any) -> list[str]:
    """Each optim / lr_scheduler_type / optim_args / lr_scheduler_kwargs value fz cannot honour, explained."""
    errors = []
    name = name_of(args.optim)
    if name not in OPTIMIZERS:
        errors.append(f"optim={name!r}: fz has no such optimizer; supported: {', '.join(sorted(OPTIMIZERS))}")
    extra = parse_optim_args(getattr(args, "optim_args", None))
    if OPTIMIZERS.get(name) == "sgd":
        bad = sorted(set(extra) - SGD_ARGS)
        if float(extra.get("dampening", 0) or 0) != 0:
            bad.append("dampening (only 0)")
    else:
        bad = sorted(extra)
    if bad:
        errors.append(f"optim_args={args.optim_args!r}: fz does not read {', '.join(bad)} for optim={name!r}"
                      + (" (sgd reads momentum, nesterov)" if OPTIMIZERS.get(name) == "sgd" else ""))
    kind = name_of(args.lr_scheduler_type)
    if kind not in SCHEDULES:
        errors.append(f"lr_scheduler_type={kind!r}: fz has no such schedule; supported: {', '.join(SCHEDULES)}")
    extra_s = set(schedule_kwargs(args)) - SCHEDULE_KWARGS.get(kind, set())
    if extra_s:
        errors.append(f"lr_scheduler_kwargs: fz does not read {', '.join(sorted(extra_s))} for "
                      f"lr_scheduler_type={kind!r}")
    return errors


def schedule_kwargs(args: Any) -> dict[str, Any]:
    kw = getattr(args, "lr_scheduler_kwargs", None) or {}
    if not isinstance(kw, Mapping):
        raise ConfigError(f"TrainingArguments.lr_scheduler_kwargs={kw!r}: must be a dict")
    return dict(kw)


def decoupled_decay(lr: Any, weight_decay: float) -> GradientTransformation:
    """updates -= lr(count) * weight_decay * params: decay beside an optimizer whose update already
    holds the lr (Adafactor)."""

    def init(params: Params) -> torch.Tensor:
        return torch.zeros((), dtype=torch.int64)

    def update(updates: Params, state: torch.Tensor, params: Params | None = None, *, donate: bool = False,
               **extra: Any) -> tuple[Params, torch.Tensor]:
        keys = list(updates)
        if keys and weight_decay:
            if params is None:
                raise ValueError("decoupled_decay needs params")
            u = owned([updates[k] for k in keys], donate)
            torch._foreach_add_(u, [params[k] for k in keys], alpha=-lr_at(lr, int(state)) * weight_decay)
            updates = dict(zip(keys, u))
        return updates, state + 1

    return GradientTransformation(init, update)


@dataclass(frozen=True)
class TrainerOptimizer:
    """What `Trainer.create_optimizer` builds for TrainingArguments.optim, as a function of the lr (a
    number or a schedule): Spec.from_deepspeed's `optimizer=` keyword, or called directly."""

    optim: str  # the TrainingArguments.optim value
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decay: frozenset[str] | None = None  # names weight decay applies to; None: every parameter
    momentum: float = 0.0  # sgd's optim_args
    nesterov: bool = False

    @property
    def kind(self) -> str:
        return OPTIMIZERS[self.optim]

    def __call__(self, lr: Any) -> GradientTransformation:
        wd, kind, names = self.weight_decay, self.kind, self.decay
        plain = not wd or names is None
        decay = optim.add_decayed_weights(wd) if names is None else masked(optim.add_decayed_weights(wd), names)
        if kind == "adamw":
            if plain:
                return optim.adamw(lr=lr, betas=self.betas, eps=self.eps, weight_decay=wd)
            return optim.chain(optim.scale_by_adam(*self.betas, self.eps), decay, optim.scale_by_learning_rate(lr, wd))
        if kind == "lion":
            if plain:
                return optim.lion(lr=lr, betas=self.betas, weight_decay=wd)
            return optim.chain(optim.scale_by_lion(*self.betas), decay, optim.scale_by_learning_rate(lr, wd))
        if kind == "sgd":
            if plain:
                return optim.sgd(lr=lr, momentum=self.momentum, nesterov=self.nesterov, weight_decay=wd)
            parts = [decay] + ([optim.trace(self.momentum, self.nesterov)] if self.momentum else [])
            return optim.chain(*parts, optim.scale_by_learning_rate(lr, wd))
        if plain:
            return _hf_adafactor(lr, wd)
        assert names is not None
        return optim.chain(_hf_adafactor(lr, 0.0), masked(decoupled_decay(lr, wd), names))

    def __repr__(self) -> str:
        args = {"adamw": f"betas={self.betas}, eps={self.eps}, ", "lion": f"betas={self.betas}, ",
                "sgd": f"momentum={self.momentum}, nesterov={self.nesterov}, ",
                "adafactor": "scale_parameter=False, relative_step=False, "}[self.kind]
        where = ("" if self.decay is None or not self.weight_decay
                 else f" on the {len(self.decay)} parameters of get_decay_parameter_names")
        return (f"TrainingArguments.optim={self.optim!r}: fz.optim.{self.kind}({args}"
                f"weight_decay={self.weight_decay}{where})")


def _hf_adafactor(lr: Any, weight_decay: float) -> GradientTransformation:
    """transformers' Adafactor(scale_parameter=False, relative_step=False, warmup_init=False), its defaults."""
    return optim.adafactor(lr=lr, beta2_decay=-0.8, eps=(1e-30, 1e-3), d=1.0, weight_decay=weight_decay,
                           capped_lr=False, scale_by_rms=False, eps1_added=True)


@dataclass(frozen=True)
class TrainerSchedule:
    """transformers' cosine and polynomial schedules (get_cosine_schedule_with_warmup,
    get_polynomial_decay_schedule_with_warmup): lr * lr_lambda(count)."""

    kind: str
    lr: float
    warmup_steps: int
    total_steps: int
    num_cycles: float = 0.5
    lr_end: float = 1e-7
    power: float = 1.0

    def __post_init__(self) -> None:
        if self.kind == "polynomial" and not self.lr > self.lr_end:
            raise ConfigError(f"lr_scheduler_type='polynomial': lr_end ({self.lr_end}) must be smaller than "
                              f"the initial lr ({self.lr}), as transformers requires")

    def __call__(self, count: int) -> float:
        w, t = self.warmup_steps, self.total_steps
        if count < w:
            return float(self.lr * (float(count) / float(max(1, w))))
        if self.kind == "cosine":
            progress = float(count - w) / float(max(1, t - w))
            return float(self.lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(self.num_cycles) * 2.0 * progress))))
        if count > t:
            return float(self.lr * (self.lr_end / self.lr))
        pct_remaining = 1 - (count - w) / (t - w)
        return float(self.lr * (((self.lr - self.lr_end) * pct_remaining ** self.power + self.lr_end) / self.lr))


@dataclass(frozen=True)
class TrainerScheduleBuilder:
    """What `Trainer.create_scheduler` builds for lr_scheduler_type, as a function of the optimizer's
    lr: Spec.from_deepspeed's `schedule=` keyword, or called directly."""

    kind: str
    warmup_steps: int
    total_steps: int
    kwargs: tuple[tuple[str, Any], ...] = ()  # lr_scheduler_kwargs

    def __call__(self, lr: Any) -> Any:
        if not isinstance(lr, (int, float)):
            raise ConfigError(f"lr_scheduler_type={self.kind!r} needs a constant optimizer lr, got {lr!r}")
        w, t, kw = self.warmup_steps, self.total_steps, dict(self.kwargs)
        if self.kind == "linear":
            return optim.warmup_linear(lr, w, t)
        if self.kind == "constant_with_warmup":
            return optim.warmup_linear(lr, w, None)
        if self.kind == "constant":
            return optim.constant(lr)
        if self.kind == plateau.KIND:
            return plateau.Plateau(float(lr), kw)
        return TrainerSchedule(self.kind, float(lr), w, t, **kw)

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.kwargs)
        return (f"TrainingArguments.lr_scheduler_type={self.kind!r} (warmup_steps={self.warmup_steps}, "
                f"total_steps={self.total_steps}{extra})")


def optimizer_from_args(args: Any, decay: frozenset[str] | None) -> TrainerOptimizer:
    """The Trainer's optimizer for `args` (choice_errors must be empty)."""
    name = name_of(args.optim)
    extra = parse_optim_args(getattr(args, "optim_args", None)) if OPTIMIZERS[name] == "sgd" else {}
    return TrainerOptimizer(name, betas=(float(args.adam_beta1), float(args.adam_beta2)),
                            eps=float(args.adam_epsilon), weight_decay=float(args.weight_decay), decay=decay,
                            momentum=float(extra.get("momentum", 0.0) or 0.0),
                            nesterov=extra.get("nesterov", "").lower() in ("true", "1", "yes"))


def schedule_from_args(args: Any, total_steps: int) -> TrainerScheduleBuilder:
    """The Trainer's scheduler for `args` over `total_steps` (choice_errors must be empty)."""
    kw = schedule_kwargs(args)
    return TrainerScheduleBuilder(name_of(args.lr_scheduler_type), int(args.get_warmup_steps(total_steps)),
                                  total_steps, tuple(sorted(kw.items())))
