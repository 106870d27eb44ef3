"""A Trainer's DeepSpeed config against its TrainingArguments: a value the config states must be
the argument's, as transformers' HfTrainerDeepSpeedConfig checks (its fill_match), or "auto"."""
from __future__ import annotations

import warnings
from typing import Any

from fz.config.warn import DeepSpeedConfigWarning
from fz.errors import ConfigError


def lookup(cfg: dict[str, Any], path: str) -> tuple[bool, Any]:
    """(found, value) for "a.b.c", as HfDeepSpeedConfig.find_config_node + get."""
    *nodes, key = path.split(".")
    for node in nodes:
        cfg = cfg.get(node)  # type: ignore[assignment]
        if not isinstance(cfg, dict):
            return False, None
    return key in cfg, cfg.get(key)


def deepspeed_mismatches(cfg: dict[str, Any], args: Any, max_steps: int | None) -> list[str]:
    """transformers' fill_match checks (trainer_config_process / _finalize): every stated value that
    differs from its argument, one line each (`max_steps` None: not known yet, not compared)."""
    world = int(args.world_size)
    checks = [
        ("train_micro_batch_size_per_gpu", args.per_device_train_batch_size, "per_device_train_batch_size"),
        ("gradient_accumulation_steps", args.gradient_accumulation_steps, "gradient_accumulation_steps"),
        ("train_batch_size", world * args.per_device_train_batch_size * args.gradient_accumulation_steps,
         "world_size * per_device_train_batch_size * gradient_accumulation_steps"),
        ("gradient_clipping", args.max_grad_norm, "max_grad_norm"),
        ("optimizer.params.lr", args.learning_rate, "learning_rate"),
        ("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1, adam_beta2"),
        ("optimizer.params.eps", args.adam_epsilon, "adam_epsilon"),
        ("optimizer.params.weight_decay", args.weight_decay, "weight_decay"),
        ("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate"),
        ("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16 or fp16_full_eval"),
        ("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16 or bf16_full_eval"),
        ("scheduler.params.total_num_steps", max_steps, "max_steps (the Trainer's num_training_steps)"),
        ("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(max_steps or 1)),
         "warmup_steps (at least 1, as transformers fills it)"),
    ]
    out = []
    for path, want, name in checks:
        if max_steps is None and path.startswith("scheduler.params.") and path != "scheduler.params.warmup_max_lr":
            continue
        found, value = lookup(cfg, path)
        if not found or value is None or value == "auto":
            continue
        if list(value) != list(want) if isinstance(value, (list, tuple)) else value != want:
            out.append(f"- {path}={value!r} in the DeepSpeed config vs TrainingArguments {name}={want!r}")
    return out


def refuse_mismatches(cfg: dict[str, Any], args: Any, max_steps: int | None) -> None:
    """A ConfigError listing every stated value that differs from its argument."""
    mismatches = deepspeed_mismatches(cfg, args, max_steps)
    if mismatches:
        raise ConfigError("the DeepSpeed config contradicts TrainingArguments:\n" + "\n".join(mismatches)
                          + '\n(set these DeepSpeed values to "auto", or make them equal)')


def drop_last_outcome(cfg: dict[str, Any], args: Any) -> tuple[str, str] | None:
    """The config's `dataloader_drop_last` under the Trainer, which reads the argument instead (as
    transformers does, silently): mapped when the two agree, else ignored, and said at once."""
    if "dataloader_drop_last" not in cfg:
        return None
    stated, used = cfg["dataloader_drop_last"], bool(args.dataloader_drop_last)
    if stated == used:
        return "mapped", f"as TrainingArguments.dataloader_drop_last={used}, which the Trainer's loader reads"
    note = f"the Trainer's loader reads TrainingArguments.dataloader_drop_last={used} instead, as transformers does"
    warnings.warn(f"DeepSpeed config: dataloader_drop_last={stated!r} is IGNORED: {note}; set the argument to "
                  "change it", DeepSpeedConfigWarning, stacklevel=5)
    return "ignored", note
