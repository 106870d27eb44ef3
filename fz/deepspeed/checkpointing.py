"""`deepspeed.checkpointing` on fz: the activation checkpointing Megatron-style models call in
their forward (`deepspeed.checkpointing.checkpoint(layer, hidden, mask)`), and its `configure`.

`checkpoint(function, *args, **kwargs)` is torch's (non-reentrant, the random state preserved, as
DeepSpeed's CheckpointFunction preserves it): the function's activations are dropped after the
forward and recomputed in backward, inside fz's step too (at ZeRO-3 a block's parameters are
gathered again for the recompute, as for a block fz checkpoints itself). `configure` takes what
means the same with data parallelism alone (`partition_activations` and
`contiguous_checkpointing` partition activations over model-parallel ranks, of which there are
none; `num_checkpoints`), logs `synchronize` and `profile` (timing aids) as not done, and
refuses `checkpoint_in_cpu` and a model-parallel `mpu_`, naming them.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch.utils.checkpoint as torch_checkpoint

from fz.config.deepspeed import load as load_deepspeed
from fz.errors import ConfigError

log = logging.getLogger(__name__)
_configured = False
# configure's arguments and the config file's keys for them
_KEYS = {"partition_activations": "partition_activations", "contiguous_checkpointing":
         "contiguous_memory_optimization", "num_checkpoints": "number_checkpoints", "checkpoint_in_cpu":
         "cpu_checkpointing", "synchronize": "synchronize_checkpoint_boundary", "profile": "profile"}


def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)`, its activations recomputed in backward rather than kept."""
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)  # looked up now: fz marks it


def _section(deepspeed_config: Any) -> dict[str, Any]:
    """The `activation_checkpointing` section of a DeepSpeed config (a dict, a JSON path, or an
    object with a `.config` dict, as DeepSpeed's DeepSpeedConfig)."""
    cfg = getattr(deepspeed_config, "config", deepspeed_config)
    if isinstance(cfg, (str, os.PathLike)):  # read as Spec.from_deepspeed reads it (a regular file, bounded, no
        cfg = load_deepspeed(cfg)[0]  # repeated key)
    if not isinstance(cfg, dict):
        raise ConfigError(f"deepspeed.checkpointing.configure: deepspeed_config is a {type(cfg).__name__}; pass the "
                          "config dict or its JSON path")
    section = cfg.get("activation_checkpointing") or {}
    return section if isinstance(section, dict) else {}


def configure(mpu_: Any, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """DeepSpeed's configure: the arguments override the config's `activation_checkpointing`."""
    global _configured
    if mpu_ is not None:
        raise ConfigError("deepspeed.checkpointing.configure: an mpu (model parallelism) is not fz's; fz is data "
                          "parallel (pass mpu_=None)")
    given = {"partition_activations": partition_activations, "contiguous_checkpointing": contiguous_checkpointing,
             "num_checkpoints": num_checkpoints, "checkpoint_in_cpu": checkpoint_in_cpu,
             "synchronize": synchronize, "profile": profile}
    section = _section(deepspeed_config) if deepspeed_config is not None else {}
    value = {k: given[k] if given[k] is not None else section.get(key) for k, key in _KEYS.items()}
    if value["checkpoint_in_cpu"]:
        raise ConfigError("deepspeed.checkpointing: checkpoint_in_cpu (cpu_checkpointing) is not done by fz: "
                          "checkpoints stay on the device; leave it off, or offload parameters and optimizer "
                          "state instead (offload_param / offload_optimizer)")
    unused = [k for k in ("synchronize", "profile") if value[k]]
    if unused:
        log.info("deepspeed.checkpointing: %s not done by fz (timing aids; the checkpoints are torch's)",
                 " and ".join(unused))
    _configured = True


def is_configured() -> bool:
    """Whether `configure` was called (DeepSpeed's `deepspeed_checkpointing_enabled`)."""
    return _configured


def reset() -> None:
    """DeepSpeed's reset of its contiguous buffers: fz keeps none."""


__all__ = ["checkpoint", "configure", "is_configured", "reset"]
