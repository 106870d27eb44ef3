"""`Spec`: everything that decides how a model trains, validated once, up front."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from fz.errors import ConfigError
from fz.offload.policy import Offload
from fz.optim import GradientTransformation, adamw
from fz.precision import PRECISIONS, LossScale

NONFINITE = ("skip", "raise")  # Spec.nonfinite
CheckpointPolicy = bool | Sequence[str] | Callable[[str, nn.Module], bool]


@dataclass(frozen=True)
class Spec:
    """How to train: ZeRO stage, optimizer, batching, clipping, precision, seed.

    Bucketing and stage-3 knobs mirror DeepSpeed's `zero_optimization` keys:
    `bucket_mb` (reduce_bucket_size / allgather_bucket_size), `persist_threshold`
    (stage3_param_persistence_threshold, in elements), `live_buckets` (how many
    gathered buckets may exist at once, the root one included; DeepSpeed's
    stage3_max_live_parameters: room beyond the root, the running block and the
    prefetched ones keeps the first blocks gathered from forward to backward, so they
    are not gathered again) and `prefetch` (blocks gathered ahead; stage3_prefetch_bucket_size).
    `shard_group_size=n` is hybrid sharding (DeepSpeed's mics_shard_size, FSDP2's HSDP):
    ZeRO shards within groups of n consecutive ranks and the groups replicate each other.
    Precision: `precision` is the compute dtype (fp32 master weights and optimizer
    moments stay fp32); `reduce_dtype` is the gradient-communication dtype
    (DeepSpeed's communication_data_type; None = fp32).
    """

    stage: int = 0
    optimizer: GradientTransformation = dataclasses.field(default_factory=lambda: adamw(lr=1e-3))
    grad_accum: int = 1
    micro_batch: int | None = None  # rows per micro-batch; when set, train_step checks batches
    clip_grad_norm: float | None = None
    precision: str = "fp32"
    reduce_dtype: str | None = None
    loss_scaling: LossScale = LossScale()
    activation_checkpointing: CheckpointPolicy = False
    loss_fn: Callable[[nn.Module, Any], Any] | None = None
    seed: int = 0
    bucket_mb: float = 25.0
    persist_threshold: int = 0
    live_buckets: int = 3
    prefetch: int = 1  # stage 3: blocks gathered ahead of use (forward and backward)
    wrap: Callable[[str, nn.Module], bool] | None = None
    log_dir: str | None = None  # TensorBoard scalars (DeepSpeed's tensorboard.output_path)
    log_every: int = 10  # DeepSpeed's steps_per_print
    csv_dir: str | None = None  # CSV scalars (DeepSpeed's csv_monitor.output_path)
    compile: bool | str = False  # torch.compile each block's forward; a str names the backend
    shard_group_size: int | None = None  # hybrid sharding: shard within groups of this many ranks (MiCS/HSDP)
    offload: Offload | None = None  # fz.offload.cpu(...) / nvme(path, ...): where optimizer state and params live
    # meta init: fn(module_name, module) after reset_parameters()
    init_fn: Callable[[str, nn.Module], None] | None = None
    weight_by_rows: bool = False  # ranks with unequal batch sizes: weight each rank's loss by its rows (else an error)
    # real models: buffers changed by training ("mean" over ranks, or "rank0": DDP's broadcast_buffers);
    # parameters that get no gradient in a step on any rank: updated as with a zero gradient (DeepSpeed)
    # or skipped (torch)
    buffer_sync: str = "mean"
    skip_unused: bool = False
    # reliability: what a NaN/inf gradient does, and how long a rank waits for the others
    nonfinite: str = "skip"  # "skip": the step leaves params and optimizer state as they were (counted); "raise"
    timeout_s: float = 300.0  # a collective or checkpoint barrier waiting longer raises fz.PeerError

    def __post_init__(self) -> None:
        def bad(field: str, value: Any, why: str) -> ConfigError:
            return ConfigError(f"Spec.{field}={value!r}: {why}")

        if not isinstance(self.stage, int) or self.stage not in (0, 1, 2, 3):
            raise bad("stage", self.stage, "ZeRO stage must be one of 0, 1, 2, 3")
        if not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise bad("grad_accum", self.grad_accum, "must be an integer >= 1 (micro-batches per step)")
        if self.micro_batch is not None and (not isinstance(self.micro_batch, int) or self.micro_batch < 1):
            raise bad("micro_batch", self.micro_batch, "must be None or an integer >= 1")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise bad("clip_grad_norm", self.clip_grad_norm, "must be > 0, or None to turn clipping off")
        if self.precision not in PRECISIONS:
            raise bad("precision", self.precision, f"must be one of {', '.join(PRECISIONS)}")
        if self.reduce_dtype is not None and self.reduce_dtype not in PRECISIONS:
            raise bad("reduce_dtype", self.reduce_dtype, f"must be None or one of {', '.join(PRECISIONS)}")
        if not isinstance(self.loss_scaling, LossScale):
            raise bad("loss_scaling", self.loss_scaling, "must be an fz.LossScale")
        if not isinstance(self.optimizer, GradientTransformation):
            raise bad("optimizer", self.optimizer, "must be an fz.optim transformation, e.g. fz.optim.adamw(lr=1e-3)")
        if not self.bucket_mb > 0:
            raise bad("bucket_mb", self.bucket_mb, "must be > 0")
        if not isinstance(self.persist_threshold, int) or self.persist_threshold < 0:
            raise bad("persist_threshold", self.persist_threshold, "must be an integer >= 0")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise bad("prefetch", self.prefetch, "must be an integer >= 0")
        if not isinstance(self.live_buckets, int) or self.live_buckets < 2 + self.prefetch:
            raise bad(
                "live_buckets",
                self.live_buckets,
                f"must be >= 2 + prefetch = {2 + self.prefetch} (the root, the running block and the prefetched ones)",
            )
        if not isinstance(self.seed, int):
            raise bad("seed", self.seed, "must be an integer")
        if not isinstance(self.compile, (bool, str)):
            raise bad("compile", self.compile, "must be True/False or a torch.compile backend name")
        if self.shard_group_size is not None and (not isinstance(self.shard_group_size, int)
                                                  or self.shard_group_size < 1):
            raise bad("shard_group_size", self.shard_group_size,
                      "must be None (shard over every rank) or an integer >= 1 that divides the world size")
        if self.offload is not None:
            if not isinstance(self.offload, Offload):
                raise bad("offload", self.offload, "must be None or a policy: fz.offload.cpu(), fz.offload.nvme(path)")
            self.offload.check_stage(self.stage)
        if self.init_fn is not None and not callable(self.init_fn):
            raise bad("init_fn", self.init_fn, "must be None or a function (module_name, module) -> None")
        if not isinstance(self.weight_by_rows, bool):
            raise bad("weight_by_rows", self.weight_by_rows, "must be True or False")
        if self.buffer_sync not in ("mean", "rank0"):
            raise bad(
                "buffer_sync", self.buffer_sync, "must be 'mean' (average over ranks) or 'rank0' (the first rank's)"
            )
        if not isinstance(self.skip_unused, bool):
            raise bad("skip_unused", self.skip_unused, "must be True or False")
        if self.skip_unused and self.offload is not None and "disk" in (self.offload.optimizer, self.offload.params):
            raise bad("skip_unused", self.skip_unused, "is not supported with the disk tier (the update streams group "
                      "by group): use fz.offload.cpu() or no offload, or skip_unused=False")
        if self.nonfinite not in NONFINITE:
            raise bad("nonfinite", self.nonfinite, f"must be one of {', '.join(map(repr, NONFINITE))}: a non-finite "
                      "gradient never reaches the weights")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise bad("timeout_s", self.timeout_s, "must be a number of seconds > 0")
        if not isinstance(self.log_every, int) or self.log_every < 1:
            raise bad("log_every", self.log_every, "must be an integer >= 1")

    @property
    def compute_dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]

    @property
    def grad_reduce_dtype(self) -> torch.dtype:
        return PRECISIONS[self.reduce_dtype or "fp32"]

    def replace(self, **changes: Any) -> Spec:
        return dataclasses.replace(self, **changes)

    # DeepSpeed configs (fz.config): where each value came from, kept out of ==.
    provenance: Any | None = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def from_deepspeed(cls, config: Any, *, strict: bool = False, **auto: Any) -> Spec:
        """A Spec from a DeepSpeed JSON config (dict or path); "auto" (and absent) values from
        `auto`, the keywords a Hugging Face Trainer would fill in. Unsupported features warn;
        `strict=True` makes them, and unknown keys, errors."""
        from fz.config.deepspeed import read_deepspeed
        return read_deepspeed(cls, config, strict=strict, **auto)

    def explain(self) -> str:
        """Every value of this Spec and its source (config, auto, default), as text."""
        from fz.config.explain import explain
        return explain(self)
