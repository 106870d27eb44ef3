"""transformers.Trainer's methods that fz.hf.Trainer's loop does not call, and a subclass's
overrides of them named when the trainer is made (never skipped in silence): an override of the
step itself (a user's, or TRL's experimental Online DPO) is refused, the others warned about. TRL's
GRPO, RLOO and Distillation trainers are run as they are written (fz/hf/online.py): their
`_prepare_inputs` and sampler are called, their `training_step`'s counting replicated; GKD's
training_step is called for each micro-batch's inputs (fz/hf/step_inputs.py)."""
from __future__ import annotations

import contextlib
import logging
from typing import Any

import transformers

from fz.errors import ConfigError
from fz.hf import step_inputs
from fz.hf.online import online_class, refused
from fz.hf.step_inputs import preparing_class

log = logging.getLogger(__name__)
REPLACED = {  # transformers.Trainer's methods fz's loop does not call, and what runs instead
    "training_step": "fz.train_step runs each step's forwards, backwards and update",
    "_inner_training_loop": "fz.hf.Trainer's loop runs",
    "get_train_dataloader": "fz.data.loader reads the training set (transformers' order and micro-batches)",
    "_get_train_sampler": "fz.data.loader reads the training set (transformers' order and micro-batches)",
    "get_batch_samples": "fz counts num_items_in_batch over the step's micro-batches itself",
    "create_optimizer": "fz builds the optimizer from the arguments or the DeepSpeed config",
    "create_scheduler": "fz builds the schedule from the arguments or the DeepSpeed config",
    "_maybe_log_save_evaluate": "fz.hf.Trainer's loop logs, evaluates and saves as transformers' does, itself",
}


def loss_context(trainer: Any) -> Any:
    """A subclass's compute_loss_context_manager, entered around each training loss as transformers'
    training_step enters it (transformers' own: none, or its amp autocast, which fz's precision replaces)."""
    own = type(trainer).compute_loss_context_manager
    if own is transformers.Trainer.compute_loss_context_manager:
        return contextlib.nullcontext()
    return trainer.compute_loss_context_manager()


def not_called(cls: type, fz_trainer: type) -> dict[str, str]:
    """{Class.method: what fz runs instead} for each override in `cls`'s chain above `fz_trainer`
    that fz's loop does not call."""
    out: dict[str, str] = {}
    for klass in cls.__mro__:
        if issubclass(fz_trainer, klass):
            break
        for name, instead in REPLACED.items():
            if name in vars(klass) and not any(k.endswith("." + name) for k in out):
                out[f"{klass.__name__}.{name}"] = instead
    return out


# overrides that are the algorithm itself (Online DPO's step generates and backpropagates): not calling them would train
# something else, so they are refused, not warned about (but an online trainer's, which fz/hf/online.py calls)
ALGORITHM = ("training_step", "_prepare_inputs")
# TRL's overrides that only enter activation offloading (refused when it is on: fz's step is not theirs)
WRAPPERS = {"SFTTrainer.training_step", "DPOTrainer.training_step", "RewardTrainer.training_step",
            "KTOTrainer.training_step"}
# Trainer arguments of subclasses (TRL's) whose work happens where fz's loop does not call it
ARGUMENTS = {
    "sync_ref_model": "TRL's SyncRefModelCallback mixes the policy into the reference model's module, which fz holds "
                      "in a State of its own: the reference would never change",
    "activation_offloading": "TRL offloads activations inside its training_step, which fz's loop replaces; use "
                             "fz's activation checkpointing (gradient_checkpointing=True)",
}


def refuse_algorithms(trainer: Any, fz_trainer: type) -> None:
    """A ConfigError naming each override of the step that is more than a wrapper, and each argument
    whose work fz's loop would skip (ARGUMENTS), when the trainer is made."""
    problems = []
    online = online_class(trainer)
    for klass in type(trainer).__mro__:
        if issubclass(fz_trainer, klass):
            break
        for name in ALGORITHM:
            where = f"{klass.__name__}.{name}"
            if name not in vars(klass) or (where in WRAPPERS and klass.__module__.startswith("trl.")):
                continue
            if online is not None and (name == "_prepare_inputs" or klass is online):
                continue  # called by fz's loop (_prepare_inputs), or only counting micro-steps (replicated)
            if name == "training_step" and klass is preparing_class(trainer):
                continue  # called by fz's loop for each micro-batch's inputs (fz/hf/step_inputs.py)
            if klass.__module__.startswith("trl."):  # TRL's own: the user cannot move its work elsewhere
                problems.append(f"{where}: TRL's {klass.__name__} is not one fz runs (its step does work fz's loop "
                                "does not call); fz runs TRL's SFT, DPO, Reward, KTO, GRPO, RLOO, "
                                "Distillation and GKD trainers")
                break
            problems.append(f"{where} is overridden: fz's loop runs fz.train_step instead of it, so what it "
                            "does (generating or scoring samples, changing the batch) would not happen. Put "
                            "per-micro-batch work in compute_loss, per-step work in a TrainerCallback")
    for field, why in ARGUMENTS.items():
        if getattr(trainer.args, field, False):
            problems.append(f"{field}=True: {why}")
    problems += refused(trainer) + step_inputs.refused(trainer)
    if problems:
        raise ConfigError(f"fz.hf: {type(trainer).__name__} cannot train on fz as given:\n- " + "\n- ".join(problems))


def warn_not_called(trainer: Any, fz_trainer: type) -> None:
    refuse_algorithms(trainer, fz_trainer)
    online = online_class(trainer)
    for method, instead in not_called(type(trainer), fz_trainer).items():
        if method.rsplit(".", 1)[1] in ALGORITHM:
            continue  # refused above unless a wrapper, which adds nothing fz's step needs
        if online is not None and (method.endswith("._get_train_sampler") or
                                   method == f"{online.__name__}.get_train_dataloader"):
            continue  # fz reads the online trainer's sampler and generation batches (fz/hf/online.py)
        log.warning("fz.hf: %s is not called on fz: %s (what the override adds there does not apply)", method,
                    instead)
