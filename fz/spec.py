"""`Spec`: everything that decides how a model trains, validated once, up front."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.nn as nn

from fz.errors import ConfigError
from fz.optim import GradientTransformation, adamw

PRECISIONS = ("fp32",)
LATER_PRECISIONS = ("bf16", "fp16")


@dataclass(frozen=True)
class Spec:
    """How to train: ZeRO stage, optimizer, batching, clipping, precision, seed.

    Bucketing and stage-3 knobs mirror DeepSpeed's `zero_optimization` keys:
    `bucket_mb` (reduce_bucket_size / allgather_bucket_size), `persist_threshold`
    (stage3_param_persistence_threshold, in elements), `live_buckets` (how many
    gathered buckets may exist at once, the root one included).
    """

    stage: int = 0
    optimizer: GradientTransformation = dataclasses.field(default_factory=lambda: adamw(lr=1e-3))
    grad_accum: int = 1
    clip_grad_norm: Optional[float] = None
    precision: str = "fp32"
    loss_fn: Optional[Callable[[nn.Module, Any], Any]] = None
    seed: int = 0
    bucket_mb: float = 25.0
    persist_threshold: int = 0
    live_buckets: int = 2
    wrap: Optional[Callable[[str, nn.Module], bool]] = None

    def __post_init__(self) -> None:
        def bad(field: str, value: Any, why: str) -> ConfigError:
            return ConfigError(f"Spec.{field}={value!r}: {why}")

        if not isinstance(self.stage, int) or self.stage not in (0, 1, 2, 3):
            raise bad("stage", self.stage, "ZeRO stage must be one of 0, 1, 2, 3")
        if not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise bad("grad_accum", self.grad_accum, "must be an integer >= 1 (micro-batches per step)")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise bad("clip_grad_norm", self.clip_grad_norm, "must be > 0, or None to turn clipping off")
        if self.precision in LATER_PRECISIONS:
            raise bad("precision", self.precision, "mixed precision is not available yet; use 'fp32'")
        if self.precision not in PRECISIONS:
            raise bad("precision", self.precision, f"must be one of {PRECISIONS}")
        if not isinstance(self.optimizer, GradientTransformation):
            raise bad("optimizer", self.optimizer, "must be an fz.optim transformation, e.g. fz.optim.adamw(lr=1e-3)")
        if not self.bucket_mb > 0:
            raise bad("bucket_mb", self.bucket_mb, "must be > 0")
        if not isinstance(self.persist_threshold, int) or self.persist_threshold < 0:
            raise bad("persist_threshold", self.persist_threshold, "must be an integer >= 0")
        if not isinstance(self.live_buckets, int) or self.live_buckets < 2:
            raise bad("live_buckets", self.live_buckets, "must be >= 2 (the root bucket plus one block)")
        if not isinstance(self.seed, int):
            raise bad("seed", self.seed, "must be an integer")

    def replace(self, **changes: Any) -> "Spec":
        return dataclasses.replace(self, **changes)
