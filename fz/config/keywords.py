"""The keyword arguments of `Spec.from_deepspeed`: the values a Hugging Face Trainer fills in.

`TRAINER` maps each keyword to the TrainingArguments (or model) value the Trainer uses for
it, so a Trainer setup translates one to one. Keywords are checked like config values;
unknown names are errors (a TrainingArguments name says which keyword it is).
"""
from __future__ import annotations

from typing import Any

from fz.config.values import Check, betas, choice, integer, number, optional
from fz.errors import ConfigError, suggest

COUNT = integer(1, 2**62)
TRAINER = {  # keyword -> what the Trainer fills "auto" with
    "lr": "learning_rate",
    "betas": "(adam_beta1, adam_beta2)",
    "eps": "adam_epsilon",
    "weight_decay": "weight_decay",
    "micro_batch": "per_device_train_batch_size",
    "grad_accum": "gradient_accumulation_steps",
    "clip_grad_norm": "max_grad_norm",
    "precision": '"bf16" if bf16 else "fp16" if fp16 else "fp32"',
    "total_steps": "max_steps (or the steps the epochs make)",
    "warmup_steps": "warmup_steps (or warmup_ratio * total_steps, rounded up)",
    "hidden_size": "model.config.hidden_size",
    "optimizer": "optim (Trainer.create_optimizer): lr -> transformation, without an optimizer section",
    "schedule": "lr_scheduler_type (Trainer.create_scheduler): lr -> schedule, without a scheduler section",
}
AUTO_NAMES = tuple(TRAINER)


def _builder(path: str, v: Any) -> Any:
    """`optimizer=` / `schedule=`: a callable of the optimizer's lr (fz.hf passes the Trainer's)."""
    if not callable(v):
        raise ConfigError(f"{path}: must be a callable taking the optimizer's lr, got {type(v).__name__}")
    return v


CHECKS: dict[str, Check] = {
    "lr": number(0.0), "betas": betas, "eps": number(0.0), "weight_decay": number(0.0),
    "micro_batch": COUNT, "grad_accum": COUNT,
    "clip_grad_norm": optional(number(0.0)),  # 0 or None: off (the Trainer's max_grad_norm=0)
    "precision": choice(("fp32", "bf16", "fp16")),
    "total_steps": COUNT, "warmup_steps": integer(0, 2**62),  # 0: the Trainer's default
    "hidden_size": COUNT, "world_size": COUNT, "optimizer": _builder, "schedule": _builder,
}
_TRAINER_NAMES = {"learning_rate": "lr", "adam_epsilon": "eps", "per_device_train_batch_size": "micro_batch",
                  "gradient_accumulation_steps": "grad_accum", "max_grad_norm": "clip_grad_norm",
                  "max_steps": "total_steps", "adam_beta1": "betas", "adam_beta2": "betas",
                  "bf16": "precision", "fp16": "precision"}


def check_keywords(auto: dict[str, Any]) -> dict[str, Any]:
    """The keywords, checked; clip_grad_norm None becomes 0.0 (off, as a config's 0)."""
    out = {}
    for k, v in auto.items():
        if k not in CHECKS:
            hint = (f" (the Trainer's {k} is {_TRAINER_NAMES[k]}=)" if k in _TRAINER_NAMES
                    else suggest(k, list(CHECKS)))
            raise ConfigError(f"Spec.from_deepspeed: unknown keyword {k!r}{hint}; "
                              f"\"auto\" values are filled from {', '.join(AUTO_NAMES)}; also world_size, strict")
        out[k] = CHECKS[k](k, v)
    if "clip_grad_norm" in out and out["clip_grad_norm"] is None:
        out["clip_grad_norm"] = 0.0
    return out
