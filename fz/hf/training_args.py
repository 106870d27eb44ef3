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
import os
from typing import Any

import transformers

from fz.errors import ConfigError


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
        launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if launched > 1 and self.world_size == 1:
            raise ConfigError(
                f"TrainingArguments: the launcher started {launched} processes, but transformers set each up to train "
                f"alone (parallel_mode={self.parallel_mode.value}, device {self.device}): each would train on the "
                "same data. " + ("On a machine without a GPU pass use_cpu=True (--use_cpu), so that the processes "
                                 "train together over gloo." if self.device.type == "cpu" else
                                 "Check that every process sees its GPU (CUDA_VISIBLE_DEVICES)."))


def as_fz_arguments(args: Any) -> TrainingArguments:
    """`args` as fz's TrainingArguments (a transformers one is copied field by field)."""
    if isinstance(args, TrainingArguments):
        return args
    if not isinstance(args, transformers.TrainingArguments):
        raise TypeError(f"fz.hf.Trainer: args must be a TrainingArguments, got {type(args).__name__}")
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    return TrainingArguments(**values)
