"""`fz.hf.TrainingArguments`: transformers' arguments, whose `deepspeed` config fz reads.

transformers' own TrainingArguments hands a `deepspeed=` config to Accelerate, which then
needs DeepSpeed installed and sets DeepSpeed up as the engine. These arguments keep the
value in `args.deepspeed` (scripts and HfArgumentParser's `--deepspeed` flag read it as
before) but set the devices up as a plain run would, so fz's Trainer trains with it and
DeepSpeed need not be installed. Nothing else changes: every field, default and check is
transformers' own. `OnFzArguments` does this for any arguments class: `fz.hf.on_fz(trl.SFTConfig)`
is SFTConfig with every field it has, on fz.
"""
from __future__ import annotations

import copyreg
import dataclasses
import logging
import os
from typing import Any

import transformers

from fz.errors import ConfigError
from fz.hf.arguments import check_deepspeed


def _not_ddp_advice(record: logging.LogRecord) -> bool:
    """transformers' advice to launch for DDP when a process group exists in a one-process run: the
    group is fz's own (fz.init starts one at world 1), not a launch gone wrong."""
    return "parallel_mode != ParallelMode.DISTRIBUTED" not in record.getMessage()


class OnFzArguments:
    """The mixin: `deepspeed=` kept from Accelerate while the devices are set up, then checked
    against the processes the launcher started. (It declares no field, nor an annotation: HfArgumentParser
    reads the arguments class's own.)"""

    def __post_init__(self) -> None:
        me: Any = self
        config, me.deepspeed = me.deepspeed, None
        told = logging.getLogger(transformers.training_args.__name__)
        told.addFilter(_not_ddp_advice)
        try:
            super().__post_init__()  # type: ignore[misc]  # the arguments class this mixes into
            _ = self._setup_devices  # type: ignore[attr-defined]  # cached now, while Accelerate sees no DeepSpeed config
        finally:
            me.deepspeed = config
            told.removeFilter(_not_ddp_advice)
        args: Any = self
        launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if launched > 1 and args.world_size == 1:
            raise ConfigError(
                f"TrainingArguments: the launcher started {launched} processes, but transformers set each up to train "
                f"alone (parallel_mode={args.parallel_mode.value}, device {args.device}): each would train on the "
                "same data. " + ("On a machine without a GPU pass use_cpu=True (--use_cpu), so that the processes "
                                 "train together over gloo." if args.device.type == "cpu" else
                                 "Check that every process sees its GPU (CUDA_VISIBLE_DEVICES)."))
        if args.deepspeed:
            check_deepspeed(args)  # its errors now: transformers reads the file now too

    @property
    def place_model_on_device(self) -> bool:
        """False: the Trainer does not put the whole model on the device when it is made (nor does
        it under DeepSpeed); fz shards it from where it is (fz/hf/model_calls.py)."""
        return False

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as the arguments class it mixes into, with every field (`training_args.bin`, as
        transformers' save_model writes it, loads without fz, as what Trainer + DeepSpeed saves)."""
        base = next(c for c in type(self).__mro__[1:] if not issubclass(c, OnFzArguments))
        return copyreg._reconstructor, (base, object, None), dict(self.__dict__)  # type: ignore[attr-defined]


@dataclasses.dataclass
class TrainingArguments(OnFzArguments, transformers.TrainingArguments):
    """transformers.TrainingArguments; `deepspeed` (a JSON path or dict) is read by fz.hf.Trainer."""


_MADE: dict[type, type] = {transformers.TrainingArguments: TrainingArguments}


def arguments_on_fz(cls: type) -> type:
    """`cls` (a TrainingArguments subclass) with OnFzArguments mixed in: the same dataclass fields."""
    if issubclass(cls, OnFzArguments):
        return cls
    if cls not in _MADE:
        made = type(cls.__name__, (OnFzArguments, cls), {"__module__": cls.__module__,
                                                         "__qualname__": cls.__qualname__,
                                                         "__doc__": f"{cls.__name__}, on fz (fz.hf.on_fz)."})
        _MADE[cls] = dataclasses.dataclass(made)
    return _MADE[cls]


def as_fz_arguments(args: Any) -> Any:
    """`args` as arguments on fz: of its own class with OnFzArguments (copied field by field)."""
    if isinstance(args, OnFzArguments):
        return args
    if not isinstance(args, transformers.TrainingArguments):
        raise TypeError(f"fz.hf.Trainer: args must be a TrainingArguments, got {type(args).__name__}")
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    return arguments_on_fz(type(args))(**values)
