"""What DeepSpeed's engine tells of its run (its getters), read from the State and the config: the
engine's counters live in fz/deepspeed/engine.py, the run's settings here."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import fz

_DS_REDUCE_BUCKET = 500_000_000  # DeepSpeed 0.19's default of what fz's config does not set


class EngineInfo:
    """The DeepSpeed engine's getters of its settings (`engine.train_batch_size()`, `engine.get_batch_info()`)."""

    state: fz.State
    config: dict[str, Any]

    @property
    def global_steps(self) -> int:
        return int(self.state.step)

    @property
    def skipped_steps(self) -> int:
        return int(self.state.scaler["skipped"]) if self.state.scaler and "skipped" in self.state.scaler else 0

    @property
    def global_rank(self) -> int:
        return self.state.plan.rank

    @property
    def world_size(self) -> int:
        return len(self.state.plan.ranks)

    dp_world_size = world_size

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self.global_rank))

    @property
    def device(self) -> torch.device:
        return self.state.plan.device

    def zero_optimization_stage(self) -> int:
        return int(self.state.spec.stage)

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def gradient_accumulation_steps(self) -> int:
        return int(self.state.spec.grad_accum)

    def train_micro_batch_size_per_gpu(self) -> int:
        return int(self.state.spec.micro_batch or self.config.get("train_micro_batch_size_per_gpu", 1))

    def train_batch_size(self) -> int:
        return self.train_micro_batch_size_per_gpu() * self.gradient_accumulation_steps() * self.world_size

    def fp16_enabled(self) -> bool:
        return self.state.spec.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.state.spec.precision == "bf16"

    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps), as DeepSpeed's."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def steps_per_print(self) -> int | None:
        """The config's; None when it sets none, as DeepSpeed 0.19's (whose default is None)."""
        value = self.config.get("steps_per_print")
        return None if value is None else int(value)

    def wall_clock_breakdown(self) -> bool:
        return bool(self.config.get("wall_clock_breakdown", False))

    def zero_reduce_bucket_size(self) -> int:
        zero = self.config.get("zero_optimization") or {}
        return int(zero.get("reduce_bucket_size", _DS_REDUCE_BUCKET)) if isinstance(zero, dict) else _DS_REDUCE_BUCKET

    @property
    def mp_world_size(self) -> int:
        return 1  # data parallelism only: no model-parallel group

    @property
    def data_parallel_group(self) -> Any:
        """The ranks it trains over (DeepSpeed's data-parallel group, for a script's own all_reduce of a metric)."""
        plan = self.state.plan
        return plan.shard_group if plan.replicas == 1 else dist.group.WORLD
