"""`Spec`: everything that decides how a model trains, validated once, up front."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.nn as nn

from fz.errors import ConfigError, suggest
from fz.offload.policy import Offload
from fz.optim import GradientTransformation, adamw
from fz.precision import PRECISIONS, LossScale

Stage = Literal[0, 1, 2, 3]
Precision = Literal["fp32", "bf16", "fp16"]
BufferSync = Literal["mean", "rank0", "local"]
NonFinite = Literal["skip", "raise"]
Accumulate = Literal["mean", "sum"]
ACCUMULATE: tuple[Accumulate, ...] = get_args(Accumulate)
NONFINITE: tuple[NonFinite, ...] = get_args(NonFinite)
BUFFER_SYNC: tuple[BufferSync, ...] = get_args(BufferSync)
CheckpointPolicy = bool | Sequence[str] | Callable[[str, nn.Module], bool]
# Spec fields that moved out of the Spec, and where to (Spec(...) with one of them says so)
MOVED = {"log_dir": "fz.Monitor(log_dir=...)", "log_every": "fz.Monitor(log_every=...)",
         "csv_dir": "fz.Monitor(csv_dir=...)"}


@dataclass(frozen=True, kw_only=True)
class Spec:
    """How to train: every setting that decides the numbers and the memory of a step, and so
    must be the same on every rank (fz.init checks that it is).

    Grouped by concern below; each field says what it is and, where there is one, its
    DeepSpeed key (`Spec.from_deepspeed` reads a DeepSpeed config into a Spec and
    `explain()` says where each value came from). Monitoring (TensorBoard, CSV, how often
    to log) is not here: it changes no number and may differ per rank, so it is `fz.Monitor`'s.
    Keyword-only: `fz.Spec(stage=2, precision="bf16")`; `spec.replace(stage=3)` for a copy.
    """

    # --- ZeRO: what is sharded, and in which groups ---
    stage: Stage = 0
    """ZeRO stage: 0 data parallel, 1 shards optimizer state, 2 also gradients, 3 also parameters
    (zero_optimization.stage). fz/sharding/stages.py is the table."""
    shard_group_size: int | None = None
    """Hybrid sharding: shard within groups of this many consecutive ranks, replicate across the
    groups (DeepSpeed's mics_shard_size, FSDP2's HSDP). None shards over every rank."""
    offload: Offload | None = None
    """Where optimizer state and parameters live: fz.offload.cpu(...) or fz.offload.nvme(path, ...)
    (zero_optimization.offload_optimizer / offload_param). None keeps them on the device."""

    # --- the optimizer and the batch ---
    optimizer: GradientTransformation = dataclasses.field(default_factory=lambda: adamw(lr=1e-3))
    """An fz.optim transformation (optax's init + update), e.g. fz.optim.adamw(lr=3e-4) (optimizer,
    scheduler)."""
    grad_accum: int = 1
    """Micro-batches per step (gradient_accumulation_steps)."""
    micro_batch: int | None = None
    """Rows per micro-batch on each rank (train_micro_batch_size_per_gpu); when set, train_step
    checks every batch against it. None takes whatever batch comes."""
    clip_grad_norm: float | None = None
    """Clip the global gradient norm to this (gradient_clipping); None does not clip."""
    loss_fn: Callable[[nn.Module, Any], Any] | None = None
    """loss_fn(model, batch) -> scalar loss. None calls model(batch) and takes the loss from it."""
    weight_by_rows: bool = False
    """Ranks with batches of different rows: weight each rank's loss by its rows. False makes
    unequal rows an error (different sequence lengths are fine: each rank's mean counts equally)."""
    accumulate: Accumulate = "mean"
    """How a step combines its micro-batches' losses (and so their gradients): "mean" averages them
    (loss_fn returns each micro-batch's mean: DeepSpeed's way); "sum" adds them, for a loss_fn
    that already divides by a count over the whole step, e.g. the label tokens of every
    micro-batch and rank (transformers' Trainer with num_items_in_batch). Across ranks the loss
    and gradients are always averaged, as DDP does; with "sum" the ranks' rows are not compared."""
    skip_unused: bool = False
    """Parameters that get no gradient in a step on any rank: False updates them as with a zero
    gradient (DeepSpeed), True leaves them and their optimizer state as they are (torch)."""
    seed: int = 0
    """Seeds what fz draws (seed): a model built on the meta device (each module from (seed, its
    name): the same weights at any world size), dropout (each rank's generators), and the data
    loader's shuffle. A model built on the CPU before fz.init already holds the values torch's
    global generator gave it: `torch.manual_seed(seed)` before building it repeats a run."""

    # --- precision ---
    precision: Precision = "fp32"
    """The compute dtype (bf16.enabled / fp16.enabled); master weights and optimizer moments stay fp32."""
    reduce_dtype: Precision | None = None
    """The gradient-communication dtype (communication_data_type); None is fp32."""
    loss_scaling: LossScale = LossScale()
    """fp16's dynamic loss scale (fp16.loss_scale, initial_scale_power, loss_scale_window, ...)."""
    nonfinite: NonFinite = "skip"
    """A NaN/inf gradient: "skip" leaves params and optimizer state as they were (counted in
    state.scaler['skipped']), "raise" stops on every rank. It never reaches the weights."""
    skip_limit: int | None = 100
    """The skipped step in a row (non-finite gradients, fp16 overflows) that raises
    fz.NonFiniteError instead: a run that skips every step learns nothing. None never stops."""

    # --- the model: blocks, recomputation, initialisation, buffers ---
    wrap: Callable[[str, nn.Module], bool] | None = None
    """wrap(name, module) -> True for the modules that are blocks (units gathered, checkpointed
    and compiled one at a time). None finds the repeated blocks (an nn.ModuleList's children)."""
    activation_checkpointing: CheckpointPolicy = False
    """Recompute blocks in backward: True for every block, a list of block names, or a function
    (name, module) -> bool (activation_checkpointing.*)."""
    compile: bool | str = False
    """torch.compile each block's forward; a str names the backend."""
    init_fn: Callable[[str, nn.Module], None] | None = None
    """Meta-device init: init_fn(module_name, module) runs on each module after reset_parameters()."""
    buffer_sync: BufferSync = "mean"
    """Buffers training changes (BatchNorm's statistics): "mean" over ranks, "rank0" (DDP's
    broadcast_buffers), or "local": each rank keeps its own (DeepSpeed's engine, which syncs none;
    a checkpoint keeps the first rank's)."""

    # --- communication: buckets and stage 3's gathering (zero_optimization's keys) ---
    bucket_mb: float = 25.0
    """MiB per communication bucket (reduce_bucket_size / allgather_bucket_size)."""
    persist_threshold: int = 0
    """Stage 3: parameters of at most this many elements stay gathered (stage3_param_persistence_threshold)."""
    live_buckets: int = 3
    """Stage 3: gathered buckets alive at once, the root one included (stage3_max_live_parameters).
    Room beyond the root, the running block and the prefetched ones keeps the first blocks
    gathered from forward to backward, so they are not gathered again."""
    prefetch: int = 1
    """Stage 3: blocks gathered ahead of use, in forward and backward (stage3_prefetch_bucket_size)."""

    # --- reliability ---
    timeout_s: float = 300.0
    """A collective or checkpoint barrier waiting longer raises fz.PeerError."""

    provenance: Any | None = dataclasses.field(default=None, compare=False, repr=False)
    """From a DeepSpeed config (fz.config): where each value came from. Not compared, may differ per rank."""

    def __new__(cls, *args: Any, **changes: Any) -> Spec:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in changes if k not in names and k not in MOVED]
        if unknown:
            raise ConfigError(f"Spec({unknown[0]}=...): no such field{suggest(unknown[0], names)}; the fields are "
                              f"{', '.join(f.name for f in dataclasses.fields(cls))} (help(fz.Spec) says what each is)")
        moved = [k for k in changes if k in MOVED]
        if moved:
            raise ConfigError(
                f"Spec({moved[0]}=...): monitoring is no longer in the Spec (it changes no number and may differ per "
                f"rank); pass it to {MOVED[moved[0]]}, or to fz.Monitor.from_spec(spec, {moved[0]}=...). A DeepSpeed "
                "config's tensorboard, csv_monitor and steps_per_print still reach Monitor.from_spec through the Spec.")
        return super().__new__(cls)

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
        if self.accumulate not in ACCUMULATE:
            raise bad("accumulate", self.accumulate, "must be 'mean' (average the micro-batches' losses) or 'sum' "
                      "(a loss_fn that divides by a count over the whole step)")
        if self.accumulate == "sum" and self.weight_by_rows:
            raise bad("weight_by_rows", True, "with accumulate='sum' the loss_fn weighs each rank itself; leave "
                      "weight_by_rows False")
        if self.buffer_sync not in BUFFER_SYNC:
            raise bad(
                "buffer_sync", self.buffer_sync, "must be 'mean' (average over ranks), 'rank0' (the first rank's) or "
                "'local' (each rank's own)"
            )
        if not isinstance(self.skip_unused, bool):
            raise bad("skip_unused", self.skip_unused, "must be True or False")
        if self.skip_unused and self.offload is not None and "disk" in (self.offload.optimizer, self.offload.params):
            raise bad("skip_unused", self.skip_unused, "is not supported with the disk tier (the update streams group "
                      "by group): use fz.offload.cpu() or no offload, or skip_unused=False")
        if self.nonfinite not in NONFINITE:
            raise bad("nonfinite", self.nonfinite, f"must be one of {', '.join(map(repr, NONFINITE))}: a non-finite "
                      "gradient never reaches the weights")
        if self.skip_limit is not None and (isinstance(self.skip_limit, bool) or not isinstance(self.skip_limit, int)
                                            or self.skip_limit < 1):
            raise bad("skip_limit", self.skip_limit, "must be an int >= 1 (steps in a row) or None (never stop)")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise bad("timeout_s", self.timeout_s, "must be a number of seconds > 0")

    @property
    def compute_dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]

    @property
    def grad_reduce_dtype(self) -> torch.dtype:
        return PRECISIONS[self.reduce_dtype or "fp32"]

    def replace(self, **changes: Any) -> Spec:
        return dataclasses.replace(self, **changes)

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
