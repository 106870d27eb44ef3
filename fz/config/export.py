"""`to_deepspeed`: a Spec as the DeepSpeed JSON that reads back into it (`Spec.from_deepspeed`).

The reverse of fz/config: the same key names, tiers (TIER) and size conversions (bucket_mb
<-> elements, buckets <-> stage3_* sizes). The optimizer and scheduler are code in fz
(`Spec.optimizer`), so they are left to the caller's own config sections.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fz.config.offload import TIER

if TYPE_CHECKING:
    from fz.offload.policy import Offload

DEVICE = {tier: device for device, tier in TIER.items()}  # fz tier -> DeepSpeed offload device


def _offload_section(policy: Offload, tier: str) -> dict[str, Any]:
    out: dict[str, Any] = {"device": DEVICE[tier]}
    if tier == "disk":
        out["nvme_path"] = policy.path
        out["buffer_count"] = policy.buffers
        out["buffer_size"] = int(policy.buffer_mb * 2**20 / 4)  # DeepSpeed counts fp32 elements
    if tier != "device":
        out["pin_memory"] = policy.pin_memory
    return out


def to_deepspeed(spec: Any, world_size: int = 1, checkpoints: int | None = None) -> dict[str, Any]:
    """The DeepSpeed config of `spec` (an fz.Spec, which imports fz.config: ZeRO, precision, batch
    sizes, clipping, checkpointing; `checkpoints`: the blocks it checkpoints, when known)."""
    elements = int(spec.bucket_mb * 2**20 / 4)
    zero: dict[str, Any] = {"stage": spec.stage, "reduce_bucket_size": elements, "allgather_bucket_size": elements}
    if spec.stage == 3:
        zero.update(stage3_param_persistence_threshold=spec.persist_threshold,
                    stage3_prefetch_bucket_size=spec.prefetch * elements,
                    stage3_max_live_parameters=spec.live_buckets * elements)
    if spec.shard_group_size is not None and spec.shard_group_size != world_size:
        zero["mics_shard_size"] = spec.shard_group_size
    policy = spec.offload
    if policy is not None and policy.active:
        if policy.optimizer != "device":
            zero["offload_optimizer"] = _offload_section(policy, policy.optimizer)
        if policy.params != "device":
            zero["offload_param"] = _offload_section(policy, policy.params)
    out: dict[str, Any] = {}
    if spec.micro_batch is not None:
        out["train_micro_batch_size_per_gpu"] = spec.micro_batch
        out["train_batch_size"] = spec.micro_batch * spec.grad_accum * world_size
    out["gradient_accumulation_steps"] = spec.grad_accum
    out["gradient_clipping"] = spec.clip_grad_norm or 0.0
    out["bf16"] = {"enabled": spec.precision == "bf16"}
    out["fp16"] = {"enabled": spec.precision == "fp16"}
    if spec.reduce_dtype is not None:
        out["communication_data_type"] = spec.reduce_dtype
    if policy is not None and "disk" in (policy.optimizer, policy.params):
        out["aio"] = {"thread_count": policy.io_threads}
    out["zero_optimization"] = zero
    if spec.activation_checkpointing:  # fz reads number_checkpoints as on; DeepSpeed only sizes contiguous buffers
        # with it, off here (on, its `deepspeed.checkpointing.configure` asserts partitioned activations)
        out["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False,
                                           "number_checkpoints": checkpoints or 1}
    prov = spec.provenance  # monitoring is fz.Monitor's; a Spec read from a config gives it back
    if prov is not None and "monitor.log_every" in prov:
        out["steps_per_print"] = prov["monitor.log_every"][0]
    out["seed"] = spec.seed
    return out


def deepspeed_json(spec: Any, world_size: int = 1, indent: int | None = 2, checkpoints: int | None = None) -> str:
    import json
    return json.dumps(to_deepspeed(spec, world_size, checkpoints), indent=indent)
