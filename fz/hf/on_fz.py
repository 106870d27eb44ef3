"""`fz.hf.on_fz(cls)`: any Hugging Face Trainer subclass, or its arguments class, on fz.

    SFTTrainer, SFTConfig = fz.hf.on_fz(trl.SFTTrainer), fz.hf.on_fz(trl.SFTConfig)

A Trainer subclass (TRL's SFTTrainer, DPOTrainer, RewardTrainer, your own) keeps every override
it has, on top of fz.hf.Trainer where it had transformers.Trainer: the class made is
`(cls, fz.hf.Trainer)`, whose method order is cls's own chain, then fz.hf.Trainer, then
transformers.Trainer, so an override's `super()` reaches fz's loop, checkpoints and
evaluation. An arguments class (SFTConfig, DPOConfig, ...) keeps every field it has, its
`deepspeed=` read by fz. Nothing is patched: the classes made are new subclasses, cached
per class.

What fz runs in place of transformers.Trainer's machinery (the step, the data loader, the
optimizer and scheduler) does not call a subclass's overrides of those; each such override
is named in a warning when the trainer is made (fz/hf/replaced.py).
"""
from __future__ import annotations

import transformers

from fz.hf.trainer import Trainer
from fz.hf.training_args import arguments_on_fz

_MADE: dict[type, type] = {transformers.Trainer: Trainer}
def on_fz(cls: type) -> type:
    """`cls` on fz: a transformers.Trainer subclass as a subclass of it and fz.hf.Trainer, or a
    TrainingArguments subclass with its `deepspeed=` read by fz (module docstring)."""
    if isinstance(cls, type) and issubclass(cls, transformers.Trainer):
        if issubclass(cls, Trainer):
            return cls
        if cls not in _MADE:
            _MADE[cls] = type(cls.__name__, (cls, Trainer), {
                "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                "__doc__": f"{cls.__name__} on fz (fz.hf.on_fz): its overrides, then fz.hf.Trainer's."})
        return _MADE[cls]
    if isinstance(cls, type) and issubclass(cls, transformers.TrainingArguments):
        return arguments_on_fz(cls)
    raise TypeError(f"fz.hf.on_fz takes a transformers.Trainer or TrainingArguments subclass, got {cls!r}")
