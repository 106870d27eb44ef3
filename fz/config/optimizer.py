"""DeepSpeed's `optimizer` and `scheduler` sections -> an fz.optim transformation.

DeepSpeed semantics kept: "Adam" with `adam_w_mode` true (its default) is AdamW, "AdamW"
always is; DeepSpeed's own optimizers default to weight_decay 0 (torch's AdamW, picked by
`torch_adam`, to 0.01); "SGD" and "Adafactor" are torch.optim's, with torch's defaults.
A scheduler becomes the optimizer's `lr=` schedule (fz.optim.schedules), with DeepSpeed's
step convention. Without an `optimizer` section the Hugging Face Trainer builds torch's
AdamW from its arguments: so does fz, from the keywords (torch's defaults for the others);
without a `scheduler` section, the Trainer's linear schedule from warmup_steps/total_steps.
The keywords `optimizer=` / `schedule=` (callables of the lr; fz.hf builds them from
TrainingArguments.optim / lr_scheduler_type) replace those two defaults.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fz import optim
from fz.config.explain import Described
from fz.config.reader import Reader
from fz.config.values import MISSING, Check, betas, boolean, choice, integer, join, number, optional
from fz.errors import ConfigError, suggest
from fz.optim.base import LR_MAX, MOMENTUM_MAX, WEIGHT_DECAY_MAX

NONNEG = number(0.0)
EPS = number(0.0, lo_open=True, why="0 divides 0 by 0 where a parameter has no gradient yet: NaN in the weights")
DECAY = number(0.0, WEIGHT_DECAY_MAX, why="no optimizer trains with more; a larger one writes inf into the weights")
MOMENTUM = number(0.0, MOMENTUM_MAX, why="a larger one grows SGD's trace at every update, to inf")
LR = number(0.0, LR_MAX)  # a learning rate: past LR_MAX the update writes inf into the weights
UNIT = number(0.0, 1.0)
STEPS = integer(1, 2**62)
WARMUP = integer(0, 2**62)  # DeepSpeed warms up over max(2, warmup_num_steps): 0 is fine

_ADAM = ({"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction", "amsgrad", "maximize"},
         {"foreach", "fused", "capturable", "differentiable", "set_grad_none"})
# type (lower case) -> (DeepSpeed name, keys fz reads, keys it ignores)
OPTIMIZERS: dict[str, tuple[str, set, set]] = {
    "adam": ("Adam", *_ADAM),
    "adamw": ("AdamW", *_ADAM),
    "lamb": ("Lamb", {"lr", "betas", "eps", "weight_decay", "bias_correction", "eps_inside_sqrt", "max_grad_norm",
                      "max_coeff", "min_coeff", "amsgrad"}, set()),
    "lion": ("Lion", {"lr", "betas", "weight_decay"}, {"set_grad_none"}),
    "sgd": ("SGD", {"lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"},
            {"foreach", "differentiable", "fused"}),
    "adafactor": ("Adafactor", {"lr", "beta2_decay", "eps", "d", "weight_decay", "maximize"}, {"foreach"}),
}
DEFAULT_LR = {"adam": 1e-3, "adamw": 1e-3, "lamb": 1e-3, "lion": 1e-3, "sgd": 1e-3, "adafactor": 1e-2}
COMPRESSED = {"onebitadam", "zerooneadam", "onebitlamb"}  # DeepSpeed's communication-compressing optimizers


def _eps_pair(path: str, v: Any) -> tuple[float | None, float]:
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ConfigError(f"{path}: {v!r} must be a list [eps1 or null, eps2]")
    return optional(EPS)(f"{path}[0]", v[0]), NONNEG(f"{path}[1]", v[1])


def _off(r: Reader, p: dict[str, Any], key: str) -> None:
    if r.get("optimizer.params", p, key, boolean, False)[0]:
        raise ConfigError(f"optimizer.params.{key}: true is not supported by fz")


class OptimizerConfig:
    """The optimizer section (or, without one, the keywords) read and checked, before the lr
    schedule is known. `source`: "config", "auto" (from keywords) or "default"."""

    def __init__(self, r: Reader, cfg: dict[str, Any]):
        self.r = r
        self.values: dict[str, Any] = {}
        d = r.section("", cfg, "optimizer")
        self.from_section = bool(d)
        self.builder: Any = MISSING if d else r.keyword("optimizer")  # a section wins, as in the Trainer
        if not d and self.builder is not MISSING:  # the Trainer's optimizer, built by the caller from the lr
            self.kind, self.source = "adamw", "auto"
            self.lr = self.get({}, "lr", LR, DEFAULT_LR["adamw"], auto="lr")
            r.record("optimizer.type", Described(repr(self.builder)), "auto",
                     "(no optimizer section: the keyword optimizer=)")
            return
        if not d:  # the Trainer's torch AdamW from its arguments
            self.kind = "adamw"
            self._read({})
            filled = any(f"optimizer.{k}" in r.entries and r.entries[f"optimizer.{k}"][1] == "auto"
                         for k in ("lr", "betas", "eps", "weight_decay"))
            self.source = "auto" if filled else "default"
            r.record("optimizer.type", "AdamW", self.source, "(no optimizer section: torch's AdamW, as the Trainer)")
            return
        r.check_keys("optimizer", d, {"type", "params"}, {"legacy_fusion", "adam_w_mode"})
        kind = d.get("type")
        if isinstance(kind, str) and kind.lower() in COMPRESSED:
            raise ConfigError(f"optimizer.type: {kind!r} compresses gradient communication, which fz does not do; "
                              "use Adam or Lamb (uncompressed)")
        if not isinstance(kind, str) or kind.lower() not in OPTIMIZERS:
            names = [v[0] for v in OPTIMIZERS.values()]
            hint = suggest(kind, names) if isinstance(kind, str) else ""
            raise ConfigError(f"optimizer.type: {kind!r} is not one of {', '.join(names)}{hint}")
        self.kind, self.source = kind.lower(), "config"
        params = r.section("optimizer", d, "params")
        name, used, ignored = OPTIMIZERS[self.kind]
        r.check_keys("optimizer.params", params, used, ignored)
        r.record("optimizer.type", name, "config", "optimizer.type")
        r.mark("optimizer.type", "mapped")
        self._read(params)

    def get(self, params: dict[str, Any], key: str, check: Check, default: Any, auto: str | None = None) -> Any:
        path = "optimizer.params"
        value, source = self.r.get(path, params, key, check, default, auto=auto)
        self.values[key] = value
        where = join(path, key) if self.from_section else f"keyword {auto}" if source == "auto" else "torch's default"
        self.r.record(f"optimizer.{key}", value, source, where)
        return value

    def _read(self, p: dict[str, Any]) -> None:
        kind, get = self.kind, self.get
        self.lr = get(p, "lr", LR, DEFAULT_LR[kind], auto="lr")
        if kind in ("adam", "adamw"):
            path = "optimizer.params"
            torch_adam = self.r.get(path, p, "torch_adam", boolean, not self.from_section)[0]
            w_mode = self.r.get(path, p, "adam_w_mode", boolean, True)[0]
            self.w_mode = kind == "adamw" or w_mode
            get(p, "betas", betas, (0.9, 0.999), auto="betas")
            get(p, "eps", EPS, 1e-8, auto="eps")
            get(p, "weight_decay", DECAY, 0.01 if torch_adam and self.w_mode else 0.0, auto="weight_decay")
            self.bias_correction = self.r.get(path, p, "bias_correction", boolean, True)[0]  # FusedAdam's
            for k in ("amsgrad", "maximize"):
                _off(self.r, p, k)
        elif kind == "lamb":
            get(p, "betas", betas, (0.9, 0.999), auto="betas")
            get(p, "eps", EPS, 1e-8, auto="eps")
            get(p, "weight_decay", DECAY, 0.0, auto="weight_decay")
            get(p, "bias_correction", boolean, True)
            get(p, "eps_inside_sqrt", boolean, False)
            get(p, "max_coeff", NONNEG, 10.0)
            get(p, "min_coeff", NONNEG, 0.01)
            if self.values["min_coeff"] > self.values["max_coeff"]:
                raise ConfigError("optimizer.params.min_coeff: must be <= max_coeff")
            if get(p, "max_grad_norm", NONNEG, 0.0):
                raise ConfigError("optimizer.params.max_grad_norm: FusedLamb's own clipping is not supported by fz; "
                                  "use gradient_clipping")
            _off(self.r, p, "amsgrad")
        elif kind == "lion":
            get(p, "betas", betas, (0.9, 0.999), auto="betas")
            get(p, "weight_decay", DECAY, 0.0, auto="weight_decay")
        elif kind == "sgd":
            get(p, "momentum", MOMENTUM, 0.0)
            get(p, "weight_decay", DECAY, 0.0, auto="weight_decay")
            get(p, "nesterov", boolean, False)
            if self.values["nesterov"] and not self.values["momentum"] > 0:
                raise ConfigError("optimizer.params.nesterov: true needs momentum > 0")
            if self.r.get("optimizer.params", p, "dampening", number(0.0), 0.0)[0] != 0:
                raise ConfigError("optimizer.params.dampening: only 0 is supported by fz")
            _off(self.r, p, "maximize")
        elif kind == "adafactor":
            get(p, "beta2_decay", number(hi=0.0), -0.8)
            get(p, "eps", _eps_pair, (None, 1e-3))
            get(p, "d", number(1.0), 1.0)
            get(p, "weight_decay", DECAY, 0.0, auto="weight_decay")
            _off(self.r, p, "maximize")

    def build(self, lr: Any) -> tuple[optim.GradientTransformation, str]:
        """The transformation with `lr` (a number or a schedule), and how to write it in fz."""
        v, kind = self.values, self.kind
        if self.builder is not MISSING:
            try:
                built = self.builder(lr)
            except ValueError as e:  # ConfigError included
                raise ConfigError(f"optimizer=: {e}") from None
            return built, Described(f"{self.builder!r} with lr={lr!r}")
        fn: Callable[..., optim.GradientTransformation]
        if kind in ("adam", "adamw"):
            fn = optim.adamw if self.w_mode else optim.adam
            args = dict(betas=v["betas"], eps=v["eps"], weight_decay=v["weight_decay"])
            if not self.bias_correction:
                args["bias_correction"] = False
        elif kind == "lamb":
            fn = optim.lamb
            args = {k: v[k] for k in ("betas", "eps", "weight_decay", "max_coeff", "min_coeff", "eps_inside_sqrt",
                                      "bias_correction")}
        elif kind == "lion":
            fn, args = optim.lion, dict(betas=v["betas"], weight_decay=v["weight_decay"])
        elif kind == "sgd":
            fn, args = optim.sgd, {k: v[k] for k in ("momentum", "nesterov", "weight_decay")}
        else:
            fn, args = optim.adafactor, {k: v[k] for k in ("beta2_decay", "eps", "d", "weight_decay")}
        try:
            transform = fn(lr=lr, **args)
        except ValueError as e:  # ConfigError included; name the section
            raise ConfigError(f"optimizer: {e}") from None
        text = ", ".join(f"{k}={a!r}" for k, a in dict(lr=lr, **args).items())
        return transform, Described(f"fz.optim.{fn.__name__}({text})")


REQUIRED, OPT_LR = MISSING, object()  # table defaults: no default / the optimizer's lr
# scheduler type -> [(key, check, default, keyword that fills "auto")]
_WARMUP = [("warmup_num_steps", WARMUP, 1000, "warmup_steps"), ("warmup_type", choice(("log", "linear")), "log", None)]
SCHEDULES: dict[str, tuple[Callable, list]] = {
    "WarmupLR": (optim.WarmupLR, [("warmup_min_lr", LR, 0.0, "warmup_min_lr"),
                                  ("warmup_max_lr", LR, OPT_LR, "lr")] + _WARMUP),
    "WarmupDecayLR": (optim.WarmupDecayLR, [("total_num_steps", STEPS, REQUIRED, "total_steps"),
                                            ("warmup_min_lr", LR, 0.0, "warmup_min_lr"),
                                            ("warmup_max_lr", LR, 0.001, "lr")] + _WARMUP),
    "WarmupCosineLR": (optim.WarmupCosineLR, [("total_num_steps", STEPS, REQUIRED, "total_steps"),
                                              ("warmup_min_ratio", UNIT, 0.0, None),
                                              ("cos_min_ratio", NONNEG, 0.0001, None)] + _WARMUP),
    "OneCycle": (optim.OneCycle, [
        ("cycle_min_lr", LR, REQUIRED, None), ("cycle_max_lr", LR, REQUIRED, None),
        ("decay_lr_rate", NONNEG, 0.0, None), ("cycle_first_step_size", STEPS, 2000, None),
        ("cycle_second_step_size", optional(STEPS), None, None),
        ("cycle_first_stair_count", integer(0, 2**62), 0, None),
        ("cycle_second_stair_count", optional(integer(0, 2**62)), None, None),
        ("decay_step_size", integer(0, 2**62), 0, None), ("cycle_momentum", boolean, True, None),
        ("cycle_min_mom", UNIT, 0.8, None), ("cycle_max_mom", UNIT, 0.9, None),
        ("decay_mom_rate", number(), 0.0, None)]),
    "LRRangeTest": (optim.LRRangeTest, [
        ("lr_range_test_min_lr", LR, 0.001, None), ("lr_range_test_step_size", STEPS, 2000, None),
        ("lr_range_test_step_rate", NONNEG, 1.0, None), ("lr_range_test_staircase", boolean, False, None)]),
}


def read_scheduler(r: Reader, cfg: dict[str, Any], opt_lr: float, has_betas: bool) -> Callable[[int], float] | None:
    """The schedule the scheduler section describes; without one, the Trainer's (or None)."""
    d = r.section("", cfg, "scheduler")
    if not d:
        return _trainer_schedule(r, opt_lr)
    r.check_keys("scheduler", d, {"type", "params"})
    kind = d.get("type")
    if not isinstance(kind, str) or kind not in SCHEDULES:
        hint = suggest(kind, list(SCHEDULES)) if isinstance(kind, str) else ""
        raise ConfigError(f"scheduler.type: {kind!r} is not one of {', '.join(SCHEDULES)}{hint}")
    r.mark("scheduler.type", "mapped")
    cls, table = SCHEDULES[kind]
    path = "scheduler.params"
    params = r.section("scheduler", d, "params")
    r.check_keys(path, params, [t[0] for t in table] + ["last_batch_iteration"])
    if r.get(path, params, "last_batch_iteration", integer(), -1)[0] != -1:
        raise ConfigError("scheduler.params.last_batch_iteration: only -1 is supported "
                          "(fz resumes a schedule from the step count in the optimizer state)")
    args: dict[str, Any] = {}
    for key, check, default, auto in table:
        default = opt_lr if default is OPT_LR else default
        if auto == "warmup_min_lr":  # "auto" means 0, as the HF Trainer fills it
            value, source = r.get(
                path, params, key, check, default, auto_value=0.0, auto_note="0, as the Trainer fills it"
            )
        else:
            value, source = r.get(path, params, key, check, default, auto=auto)
        args[key] = value
        r.record(f"scheduler.{key}", value, source, join(path, key))
    if kind == "WarmupCosineLR":
        args["lr"] = opt_lr
    if kind == "OneCycle" and args["cycle_momentum"] and has_betas:
        r.mark(f"{path}.cycle_momentum", "unsupported",
               "fz keeps beta1 fixed" + ("" if "cycle_momentum" in params else " (DeepSpeed's default: true)"))
    _check_total(r, args.get("total_num_steps"), args.get("warmup_num_steps"), f"scheduler ({kind})")
    try:
        schedule = cls(**args)
    except ValueError as e:
        raise ConfigError(f"scheduler: {e}") from None
    r.record("scheduler", schedule, "config", "scheduler")
    return schedule


def _trainer_schedule(r: Reader, lr: float) -> Callable[[int], float] | None:
    """No scheduler section: `schedule=` (the Trainer's lr_scheduler_type, built by the caller), else the
    Trainer's default ("linear") when warmup_steps / total_steps are given."""
    warmup, total = r.keyword("warmup_steps"), r.keyword("total_steps")
    build = r.keyword("schedule")
    if build is not MISSING:  # warmup / total steps are the builder's own (marked used above)
        try:
            schedule = build(lr)
        except ValueError as e:  # ConfigError included
            raise ConfigError(f"schedule=: {e}") from None
        r.record("scheduler", schedule, "auto", "(no scheduler section: the keyword schedule=)")
        return schedule
    if warmup is MISSING and total is MISSING:
        return None
    warmup, total = 0 if warmup is MISSING else warmup, None if total is MISSING else total
    _check_total(r, total, warmup, "the Trainer's linear schedule")
    schedule = optim.warmup_linear(lr, warmup, total)
    r.record("scheduler", schedule, "auto", "(no scheduler section: the Trainer's linear schedule)")
    return schedule


def _check_total(r: Reader, total: int | None, warmup: int | None, what: str) -> None:
    if total is not None and warmup is not None and total < warmup:  # DeepSpeed warns too
        r.advice.append(f"{what}: total_num_steps={total} is less than warmup_num_steps={warmup}: "
                        "the lr never reaches its peak")
