"""transformers.TrainingArguments -> fz.Spec: what fz.hf.Trainer trains with.

`spec_from_args` makes the Spec: from `args.deepspeed` (a path, a JSON string or a dict)
through `Spec.from_deepspeed`, its "auto" values filled exactly as transformers'
HfTrainerDeepSpeedConfig fills them; from `spec=` (the ZeRO setup, the training settings from
the arguments); or, with neither, stage 0 from the arguments. A config value that contradicts
an argument is one ConfigError listing every mismatch (transformers' own list of checked keys).
`unsupported` names, in one ConfigError, every setting fz cannot honour. No setting is
dropped silently. What each TrainingArguments setting becomes:

  setting                                      fz
  -------------------------------------------  ---------------------------------------------------
  per_device_train_batch_size                  Spec.micro_batch (train_micro_batch_size_per_gpu)
  gradient_accumulation_steps                  Spec.grad_accum
  max_grad_norm                                Spec.clip_grad_norm (0 / None: off)
  learning_rate, adam_beta1/2, adam_epsilon,   the optimizer (fz.hf.optimizers); weight decay only
    weight_decay                                 on get_decay_parameter_names, as the Trainer
  optim                                        adamw_torch(_fused) -> adamw, adafactor, sgd (optim_args
                                                 momentum / nesterov), lion_32bit -> lion; else error
  lr_scheduler_type, lr_scheduler_kwargs,      linear, cosine (num_cycles), constant,
    warmup_steps (a ratio when < 1)              constant_with_warmup, polynomial (lr_end, power),
                                                 reduce_lr_on_plateau (fz/hf/plateau.py); else error
  bf16 / fp16                                  Spec.precision (fp16: GradScaler's dynamic scale)
  seed                                         Spec.seed (a DeepSpeed config's "seed" wins)
  gradient_checkpointing /                     Spec.activation_checkpointing=True (the kwargs are
    activation_checkpointing (+ _kwargs)         torch.utils.checkpoint's mechanics: no effect)
  deepspeed                                    Spec.from_deepspeed; its optimizer / scheduler sections
                                                 win over optim / lr_scheduler_type, as in transformers
  torch_compile(_backend, _mode)               error: fz compiles blocks itself (Spec(compile=...))
  fsdp, fsdp_config, parallelism_config        error: fz is the sharding (stage 3); no TP / SP / CP
  use_liger_kernel, liger_kernel_config        error: patches the model's kernels outside fz
  neftune_noise_alpha                          transformers' forward hook, run by fz's copy (added_hooks)
  auto_find_batch_size                         error: retries on OOM with smaller batches, not in fz
  optim_target_modules                         error: GaLore / APOLLO only
  fp16_full_eval, bf16_full_eval               error: fz evaluates in Spec.precision
  label_smoothing_factor                       transformers' compute_loss, run by fz's step and evaluation
  debug (underflow_overflow, ...)              error: its hooks need the whole module
  ddp_backend other than gloo / nccl           error: fz runs on gloo (CPU) and NCCL (CUDA)
  deepspeed together with spec=                error: two ZeRO setups
  a quantized or device_map-dispatched model   error
  a model in bf16 / fp16                       trained from fp32 masters of its values (DeepSpeed's)
  ddp_* (others), tf32, torch_empty_cache_steps,   accepted: tune DDP or the device, change no number
    full_determinism, use_cpu, dataloader_*
  logging / eval / save / hub / report_to ...  the Trainer's own (fz.hf.Trainer)
  average_tokens_across_devices,               the Trainer's loss and sampler (fz.hf.Trainer)
    train_sampling_strategy, data_seed,
    include_num_input_tokens_seen
  accelerator_config                           its defaults; split_batches=True, even_batches=False,
                                                 use_seedable_sampler=False: error (other samples)
"""
from __future__ import annotations

import dataclasses
import logging
import re
import warnings
from collections.abc import Collection
from typing import Any

import torch

from fz.config.deepspeed import load as load_deepspeed
from fz.config.explain import Described, Provenance
from fz.errors import ConfigError
from fz.hf.config_mismatch import drop_last_outcome, lookup, refuse_mismatches
from fz.hf.data import sampling
from fz.hf.optimizers import choice_errors, optimizer_from_args, schedule_from_args
from fz.precision import LossScale
from fz.spec import Spec

__all__ = ["spec_from_args", "check_deepspeed", "unsupported", "decay_parameter_names", "ARGUMENT"]
log = logging.getLogger(__name__)
GRAD_SCALER = LossScale(initial_scale_power=16, loss_scale_window=2000, hysteresis=1,  # torch.amp.GradScaler's
                        growth="grad_scaler")
ARGUMENT = {  # Spec.from_deepspeed keyword -> the TrainingArguments field (explain names it)
    "lr": "TrainingArguments.learning_rate", "betas": "TrainingArguments.adam_beta1/adam_beta2",
    "eps": "TrainingArguments.adam_epsilon", "weight_decay": "TrainingArguments.weight_decay",
    "micro_batch": "TrainingArguments.per_device_train_batch_size",
    "grad_accum": "TrainingArguments.gradient_accumulation_steps",
    "clip_grad_norm": "TrainingArguments.max_grad_norm", "precision": "TrainingArguments.bf16/fp16",
    "total_steps": "max_steps", "warmup_steps": "max(1, TrainingArguments.warmup_steps)",  # as transformers fills it
    "hidden_size": "model.config.hidden_size", "optimizer": "TrainingArguments.optim",
    "schedule": "TrainingArguments.lr_scheduler_type",
}
_NAMES = "|".join(ARGUMENT)
_KEYWORD = re.compile(rf"(?:the )?keyword ({_NAMES})\b=?")  # "keyword lr", "the keyword optimizer="
_ASSIGNED = re.compile(rf"\b({_NAMES})=")  # "lr=5e-05"


def precision_of(args: Any) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def hidden_size_of(model: torch.nn.Module) -> int | None:
    """model.config's hidden size as trainer_config_finalize finds it (the largest of hidden_sizes)."""
    config = getattr(model, "config", None)
    for c in (config, getattr(config, "text_config", None)):
        if c is None:
            continue
        if isinstance(getattr(c, "hidden_size", None), int):
            return int(c.hidden_size)
        if getattr(c, "hidden_sizes", None):
            return int(max(c.hidden_sizes))
    return None


def decay_parameter_names(model: torch.nn.Module) -> frozenset[str]:
    """transformers.Trainer.get_decay_parameter_names: no biases, no LayerNorm / *norm weights."""
    import transformers
    # an instance method that reads nothing of the instance: transformers' own rule, whatever its version
    return frozenset(transformers.Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]


def _keywords(cfg: dict[str, Any], args: Any, model: torch.nn.Module, max_steps: int, optimizer: Any,
              schedule: Any) -> dict[str, Any]:
    """The Spec.from_deepspeed keywords: the values transformers fills "auto" with."""
    kw: dict[str, Any] = dict(
        micro_batch=args.per_device_train_batch_size, grad_accum=args.gradient_accumulation_steps,
        clip_grad_norm=args.max_grad_norm, lr=args.learning_rate, precision=precision_of(args),
        total_steps=max_steps, warmup_steps=max(1, args.get_warmup_steps(max_steps)), world_size=args.world_size)
    if cfg.get("optimizer"):  # DeepSpeed's optimizer, its "auto" from the arguments
        kw.update(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon, weight_decay=args.weight_decay)
    else:  # the Trainer's create_optimizer
        kw["optimizer"] = optimizer
    if not cfg.get("scheduler"):  # the Trainer's create_scheduler, on whichever optimizer
        kw["schedule"] = schedule
    hidden = hidden_size_of(model)
    if hidden is not None:
        kw["hidden_size"] = hidden
    return kw


def _named(text: str) -> str:
    """A provenance note with Spec.from_deepspeed's keyword names as TrainingArguments fields."""
    text = _KEYWORD.sub(lambda m: ARGUMENT[m.group(1)], text)
    return _ASSIGNED.sub(lambda m: ARGUMENT[m.group(1)] + "=", text)


def _with_arguments(spec: Spec, prov: Provenance, extra: dict[str, tuple[Any, str, str]],
                    notes: dict[str, tuple[str, str]] | None = None) -> Spec:
    """`spec` with `extra` (field -> (value, source, where)) set and provenance naming arguments
    (`notes`: config keys whose outcome the Trainer changes)."""
    entries = dict(prov.items())
    keys = {k: _named(v) for k, v in prov.ds_keys.items()}
    changes = {}
    for field, (value, source, where) in extra.items():
        changes[field] = value
        entries[field], keys[field] = (value, source), where
    outcomes = {p: (o, _named(note)) for p, (o, note) in prov.outcomes.items()} | (notes or {})
    # every argument is passed whatever the config holds: "keywords the config had no use for" would be noise
    new = Provenance(entries, keys, outcomes, [], prov.origin, objects=prov.objects, kind=prov.kind)
    return spec.replace(**changes, provenance=new)


def choice_problems(args: Any, cfg: dict[str, Any]) -> list[str]:
    """Each optim / lr_scheduler_type value (and their arguments) fz has not; not those a DeepSpeed
    config's optimizer or scheduler section replaces (transformers ignores them then)."""
    replaced = (("optim",) if cfg.get("optimizer") else ()) + (("lr_scheduler",) if cfg.get("scheduler") else ())
    return [e for e in choice_errors(args) if not e.startswith(replaced)]


def refuse_choices(args: Any, cfg: dict[str, Any]) -> None:
    errors = choice_problems(args, cfg)
    if errors:
        raise ConfigError("TrainingArguments fz cannot honour:\n- " + "\n- ".join(errors))


def check_deepspeed(args: Any) -> None:
    """`args.deepspeed` checked when the arguments are made, as far as it needs no model nor data:
    the file, its keys and values, its contradictions with the arguments (transformers reads the
    file then too; TRL would tokenize the data first). The Trainer reads it again, and warns."""
    cfg, _ = load_deepspeed(args.deepspeed)
    refuse_choices(args, cfg)
    known = args.max_steps if args.max_steps > 0 else None
    refuse_mismatches(cfg, args, known)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # said once, when the Trainer reads it
        steps = known or max(1000, args.get_warmup_steps(1000) + 1)  # a stand-in where the data sets it
        kw = _keywords(cfg, args, torch.nn.Linear(1, 1), steps,
                       None if cfg.get("optimizer") else optimizer_from_args(args, None),
                       None if cfg.get("scheduler") else schedule_from_args(args, steps))
        stated = {k for k, key in (("total_steps", "total_num_steps"), ("warmup_steps", "warmup_num_steps"))
                  if lookup(cfg, f"scheduler.params.{key}")[1] not in (None, "auto")}
        Spec.from_deepspeed(cfg, **{k: v for k, v in kw.items() if k != "hidden_size" and (known or k not in stated)})


def _from_deepspeed(args: Any, cfg: dict[str, Any], model: torch.nn.Module, max_steps: int, optimizer: Any,
                    schedule: Any) -> Spec:
    refuse_mismatches(cfg, args, max_steps)
    spec = Spec.from_deepspeed(args.deepspeed, **_keywords(cfg, args, model, max_steps, optimizer, schedule))
    extra: dict[str, tuple[Any, str, str]] = {}
    if "seed" not in cfg:
        extra["seed"] = (int(args.seed), "args", "TrainingArguments.seed")
    if _checkpointing(args) and spec.activation_checkpointing is False:
        extra["activation_checkpointing"] = (True, "args", _checkpointing(args))
    drop_last = drop_last_outcome(cfg, args)
    assert isinstance(spec.provenance, Provenance)
    return _with_arguments(spec, spec.provenance, extra, {"dataloader_drop_last": drop_last} if drop_last else None)


def _checkpointing(args: Any) -> str:
    """The argument that turns activation checkpointing on, or ""."""
    for name in ("gradient_checkpointing", "activation_checkpointing"):
        if getattr(args, name, None):
            return f"TrainingArguments.{name}"
    return ""


def _default_optimizer(o: Any) -> bool:
    """Whether `o` is Spec()'s own optimizer (fz.optim.adamw's defaults), i.e. not chosen by the user."""
    want = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    return type(o) is type(Spec().optimizer) and all(getattr(o, k, None) == v for k, v in want.items())


def _from_args(args: Any, spec: Spec | None, optimizer: Any, schedule: Any) -> Spec:
    """Stage 0 (or `spec`'s ZeRO setup) with what the arguments decide."""
    base = spec if spec is not None else Spec()
    default = Spec()
    lr_schedule = schedule(float(args.learning_rate))
    try:
        transform = optimizer(lr_schedule)
    except ValueError as e:  # ConfigError included
        raise ConfigError(f"TrainingArguments.optim={getattr(optimizer, 'optim', optimizer)!r}: {e}") from None
    precision = precision_of(args)
    values: dict[str, tuple[Any, str]] = {
        "micro_batch": (int(args.per_device_train_batch_size), "per_device_train_batch_size"),
        "grad_accum": (int(args.gradient_accumulation_steps), "gradient_accumulation_steps"),
        "clip_grad_norm": (float(args.max_grad_norm) if args.max_grad_norm else None, "max_grad_norm"),
        "precision": (precision, "bf16" if args.bf16 else "fp16" if args.fp16 else "bf16 / fp16"),
        "seed": (int(args.seed), "seed"),
    }
    if precision == "fp16" and base.loss_scaling == default.loss_scaling:
        values["loss_scaling"] = (GRAD_SCALER, "fp16 (torch.amp.GradScaler's dynamic scale)")
    if _checkpointing(args) and base.activation_checkpointing is False:
        values["activation_checkpointing"] = (True, _checkpointing(args).removeprefix("TrainingArguments."))
    conflicts = [f"- spec.{f}={getattr(base, f)!r} vs TrainingArguments.{name}={v!r}"
                 for f, (v, name) in values.items()
                 if getattr(base, f) != getattr(default, f) and getattr(base, f) != v]
    if spec is not None and not _default_optimizer(spec.optimizer):
        conflicts.append("- spec.optimizer is set, but the Trainer builds the optimizer from TrainingArguments "
                         "(optim, learning_rate, lr_scheduler_type, ...)")
    if conflicts:
        raise ConfigError("spec= contradicts TrainingArguments:\n" + "\n".join(conflicts)
                          + "\n(leave these Spec fields at their defaults: the arguments set them)")
    entries = {f: (v, "args") for f, (v, _) in values.items()}
    keys = {f: f"TrainingArguments.{name}" for f, (_, name) in values.items()}
    text = Described(f"{optimizer!r} with lr={lr_schedule!r}")
    given = "the Trainer's optimizers= / optimizer_cls_and_kwargs="  # a user's torch optimizer (client_optimizers)
    by_args = hasattr(optimizer, "optim")
    entries["optimizer"], keys["optimizer"] = (text, "args"), \
        "TrainingArguments.optim / learning_rate / ..." if by_args else given
    entries["scheduler"], keys["scheduler"] = (lr_schedule, "args"), \
        "TrainingArguments.lr_scheduler_type" if hasattr(schedule, "warmup_steps") else given
    for name, value, field in (("optimizer.lr", args.learning_rate if by_args else optimizer.lr, "learning_rate"),
                               ("optimizer.betas", optimizer.betas, "adam_beta1/adam_beta2"),
                               ("optimizer.eps", optimizer.eps, "adam_epsilon"),
                               ("optimizer.weight_decay", optimizer.weight_decay, "weight_decay"),
                               ("scheduler.warmup_steps", getattr(schedule, "warmup_steps", None), "warmup_steps"),
                               ("scheduler.total_steps", getattr(schedule, "total_steps", None), "max_steps")):
        if value is None:
            continue
        entries[name] = (value, "args")
        keys[name] = f"TrainingArguments.{field}" if field != "max_steps" else "max_steps (the Trainer's)"
        keys[name] = keys[name] if by_args or name.startswith("scheduler") else given
    prov = Provenance(entries, keys, origin="" if spec is None else "with spec=", objects={"optimizer": transform},
                      kind="TrainingArguments")
    return base.replace(**{f: v for f, (v, _) in values.items()}, optimizer=transform, provenance=prov)


def spec_from_args(args: Any, model: torch.nn.Module, *, max_steps: int, spec: Spec | None = None,
                   decay_names: Collection[str] | None = None, chosen: tuple[Any, Any] = (None, None)) -> Spec:
    """The Spec fz.hf.Trainer trains `model` with, `max_steps` optimizer steps (the Trainer's
    num_training_steps). `decay_names`: the parameters weight decay applies to (default
    transformers' get_decay_parameter_names; a Trainer passes its own method's answer). `chosen`:
    the optimizer and schedule of a user's torch optimizer (fz/hf/client_optimizers.py), or None."""
    if spec is not None and args.deepspeed:
        raise ConfigError("TrainingArguments.deepspeed and spec= are both given: each is a whole ZeRO setup; "
                          "pass one")
    cfg = load_deepspeed(args.deepspeed)[0] if args.deepspeed else {}
    refuse_choices(args, cfg)
    names = frozenset(decay_names) if decay_names is not None else decay_parameter_names(model)
    every = frozenset(n for n, p in model.named_parameters() if p.requires_grad)
    optimizer = None if cfg.get("optimizer") else \
        chosen[0] or optimizer_from_args(args, None if every <= names else names)
    schedule = None if cfg.get("scheduler") else chosen[1] or schedule_from_args(args, max_steps)
    if args.deepspeed:
        return _from_deepspeed(args, cfg, model, max_steps, optimizer, schedule)
    return _from_args(args, spec, optimizer, schedule)


_UNSUPPORTED: list[tuple[str, str]] = [  # (field, why fz cannot honour it) when not at its default
    ("torch_compile", "fz compiles blocks itself: pass spec=fz.Spec(compile=True) or a backend name"),
    ("torch_compile_backend", "fz compiles blocks itself: spec=fz.Spec(compile='<backend>')"),
    ("torch_compile_mode", "fz compiles blocks itself, in torch.compile's default mode"),
    ("fsdp", "fz is the sharding: use a DeepSpeed config or spec=fz.Spec(stage=3)"),
    ("fsdp_config", "fz is the sharding: use a DeepSpeed config or spec=fz.Spec(stage=3)"),
    ("parallelism_config", "fz has no tensor, sequence or context parallelism"),
    ("use_liger_kernel", "Liger patches the model's kernels; fz does not run them"),
    ("liger_kernel_config", "Liger patches the model's kernels; fz does not run them"),
    ("auto_find_batch_size", "fz does not retry smaller batches on out-of-memory"),
    ("optim_target_modules", "GaLore / APOLLO optimizers are not in fz"),
    ("fp16_full_eval", "fz evaluates in the training precision (Spec.precision)"),
    ("bf16_full_eval", "fz evaluates in the training precision (Spec.precision)"),
    ("debug", "its hooks watch whole modules; fz's stage 3 gathers them block by block"),
]


_ACCELERATOR: list[tuple[str, object, str]] = [  # (field, the value fz reads the data as, what fz does)
    ("split_batches", False, "each rank reads per_device_train_batch_size samples a micro-batch"),
    ("even_batches", True, "an epoch's last micro-batch is filled up with its first samples on every rank"),
    ("use_seedable_sampler", True, "the order is accelerate's seedable sampler's (randperm seeded with seed + epoch)"),
]


def _accelerator_problems(config: Any) -> list[str]:
    """accelerator_config's settings that change which samples a rank reads, where not as fz reads them."""
    if config is None:
        return []
    problems = []
    for field, want, what in _ACCELERATOR:
        value = config.get(field, want) if isinstance(config, dict) else getattr(config, field, want)
        if value != want:
            problems.append(f"accelerator_config.{field}={value!r}: {what}")
    return problems


def unsupported(args: Any, model: torch.nn.Module, *, spec: Spec | None = None) -> None:
    """One ConfigError naming every TrainingArguments setting (and model property) fz cannot honour;
    None when there is none. The module docstring lists every decision."""
    import transformers
    defaults = transformers.TrainingArguments.__dataclass_fields__
    problems = []
    for field, why in _UNSUPPORTED:
        if field not in defaults:
            continue
        value = getattr(args, field, None)
        default = defaults[field].default
        off = value in (None, False, 0, 0.0, "", [], {}) or (default is not dataclasses.MISSING and value == default)
        if not off:
            problems.append(f"{field}={value!r}: {why}")
    backend = getattr(args, "ddp_backend", None)
    if backend not in (None, "gloo", "nccl"):
        problems.append(f"ddp_backend={backend!r}: fz runs on gloo (CPU) and NCCL (CUDA)")
    if spec is not None and args.deepspeed:
        problems.append("deepspeed= together with spec=: two ZeRO setups; pass one")
    problems += _accelerator_problems(getattr(args, "accelerator_config", None))
    problems += choice_problems(args, load_deepspeed(args.deepspeed)[0] if args.deepspeed else {})
    if getattr(model, "is_quantized", False) or getattr(model, "hf_quantizer", None) is not None:
        problems.append("the model is quantized: fz trains full-precision parameters")
    devices = set((getattr(model, "hf_device_map", None) or {}).values())
    if len(devices) > 1:
        problems.append(f"the model is dispatched over {len(devices)} devices (device_map): fz places it itself")
    if problems:
        raise ConfigError("fz.hf.Trainer cannot honour these settings (remove them or set them to their "
                          "defaults):\n- " + "\n- ".join(problems))


def refuse_trainer_settings(args: Any, model: torch.nn.Module, *, spec: Spec | None, model_init: Any,
                            kwargs: dict[str, Any]) -> None:
    """One ConfigError naming everything a fz.hf.Trainer is given that fz does not run: `unsupported`'s
    settings, and the Trainer's own (model_init=, the sampler)."""
    problems = []
    if model_init is not None:
        problems.append("model_init=: hyperparameter search is not in fz; build the model and pass model=")
    if sampling(args) not in ("random", "sequential", "group_by_length"):
        problems.append(f"train_sampling_strategy={sampling(args)!r}: fz reads the data in random, sequential or "
                        "length-grouped order (its micro-batches have one size)")
    try:
        unsupported(args, model, spec=spec)
    except ConfigError as e:  # its lines: a heading, then "- setting: why" per setting
        problems += [line[2:] for line in str(e).splitlines() if line.startswith("- ")] or [str(e)]
    if problems:
        raise ConfigError("fz.hf.Trainer cannot honour these settings (remove them or set them to their "
                          "defaults):\n" + "\n".join(f"- {p}" for p in problems))
