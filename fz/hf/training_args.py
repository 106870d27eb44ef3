"""`fz.hf.TrainingArguments`: transformers' arguments, whose `deepspeed` config fz reads.

transformers' own TrainingArguments hands a `deepspeed=` config to Accelerate, which then
needs DeepSpeed installed and sets DeepSpeed up as the engine. This subclass keeps the
value in `args.deepspeed` (scripts and HfArgumentParser's `--deepspeed` flag read it as
before) but sets the devices up as a plain run would, so fz's Trainer trains with it and
DeepSpeed need not be installed. Nothing else changes: every field, default and check is
transformers' own.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import transformers


@dataclasses.dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers.TrainingArguments; `deepspeed` (a JSON path or dict) is read by fz.hf.Trainer."""

    def __post_init__(self) -> None:
        config, self.deepspeed = self.deepspeed, None
        try:
            super().__post_init__()
            _ = self._setup_devices  # cached now, while no DeepSpeed config is visible to Accelerate
        finally:
            self.deepspeed = config


def as_fz_arguments(args: Any) -> TrainingArguments:
    """`args` as fz's TrainingArguments (a transformers one is copied field by field)."""
    if isinstance(args, TrainingArguments):
        return args
    if not isinstance(args, transformers.TrainingArguments):
        raise TypeError(f"fz.hf.Trainer: args must be a TrainingArguments, got {type(args).__name__}")
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    return TrainingArguments(**values)
