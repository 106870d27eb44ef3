"""transformers.Trainer's methods that fz.hf.Trainer's loop does not call, and a subclass's
overrides of them named when the trainer is made (never skipped in silence)."""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)
REPLACED = {  # transformers.Trainer's methods fz's loop does not call, and what runs instead
    "training_step": "fz.train_step runs each step's forwards, backwards and update",
    "_inner_training_loop": "fz.hf.Trainer's loop runs",
    "get_train_dataloader": "fz.data.loader reads the training set (transformers' order and micro-batches)",
    "_get_train_sampler": "fz.data.loader reads the training set (transformers' order and micro-batches)",
    "get_batch_samples": "fz counts num_items_in_batch over the step's micro-batches itself",
    "create_optimizer": "fz builds the optimizer from the arguments or the DeepSpeed config",
    "create_scheduler": "fz builds the schedule from the arguments or the DeepSpeed config",
}


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


def warn_not_called(trainer: Any, fz_trainer: type) -> None:
    for method, instead in not_called(type(trainer), fz_trainer).items():
        log.warning("fz.hf: %s is not called on fz: %s (what the override adds there does not apply)", method,
                    instead)
