"""Which DeepSpeed keys fz reads, which it accepts and ignores, and which are features it lacks.

Ignored keys tune DeepSpeed's own machinery (fz's equivalents are fixed or automatic);
unsupported ones are DeepSpeed features fz does not have (warned at load when switched on):
both are accepted and listed by `Spec.explain()`. Any other key inside a section is an error
with the closest valid key suggested; at the top level DeepSpeed accepts unknown keys, and
so does fz unless they look like a typo (fz.config.deepspeed).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fz.config.values import in_use

STEPS_PER_PRINT = 10  # DeepSpeed's default steps_per_print, and fz.Monitor's log_every


def _not(*off: Any) -> Callable[[Any], bool]:
    return lambda v: in_use(v) and v not in off


TOP_USED = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "zero_optimization", "fp16", "bf16", "bfloat16", "optimizer", "scheduler", "activation_checkpointing",
    "tensorboard", "csv_monitor", "steps_per_print", "seed", "communication_data_type", "aio", "data_types",
}
TOP_IGNORED = {
    "wall_clock_breakdown", "memory_breakdown", "dump_state", "prescale_gradients", "gradient_predivide_factor",
    "disable_allgather", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "checkpoint",
    "dataloader_drop_last", "graph_harvesting", "fp32_allreduce", "vocabulary_size",
    "disable_python_gc", "timers", "seq_parallel_communication_data_type", "seq_parallel_comm_data_type",
    "use_data_before_expert_parallelism", "load_universal_checkpoint", "use_node_local_storage",
    "managed_gradient_accumulation", "comms_logger",
}
TOP_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    k: in_use for k in (
        "amp", "torch_autocast", "wandb", "comet", "flops_profiler", "pipeline", "tensor_parallel",
        "expert_parallel", "sparse_attention", "sparse_gradients", "progressive_layer_drop", "curriculum_learning",
        "data_efficiency", "compression_training", "quantize_training", "weight_quantization", "eigenvalue",
        "elasticity", "hybrid_engine", "autotuning", "compile", "nebula",
    )
}
TOP_UNSUPPORTED["sequence_parallel_size"] = _not(1)
TOP_UNSUPPORTED["gradient_allreduce_op"] = _not("mean")

ZERO_USED = {
    "stage", "reduce_bucket_size", "allgather_bucket_size", "stage3_param_persistence_threshold",
    "param_persistence_threshold", "stage3_max_live_parameters", "max_live_parameters",
    "stage3_prefetch_bucket_size", "prefetch_bucket_size", "offload_optimizer", "offload_param",
    "cpu_offload", "cpu_offload_param", "mics_shard_size",
}
ZERO_IGNORED = {
    "contiguous_gradients", "reduce_scatter", "use_multi_rank_bucket_allreduce", "allgather_partitions",
    "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint", "sub_group_size", "cpu_offload_use_pin_memory",
    "stage3_model_persistence_threshold", "model_persistence_threshold", "stage3_max_reuse_distance",
    "max_reuse_distance", "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "stage3_module_granularity_threshold",
    "module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential", "allgather_sequential", "stage3_partition_stream_chunk_size",
    "partition_stream_chunk_size", "ignore_unused_parameters", "legacy_stage1", "round_robin_gradients",
    "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
    "enable_sanity_checks", "save_muon_momentum_buffer_in_memory", "leaf_module", "compute_grad_norm",
    "parameter_alignment", "allgather_size",
}
ZERO_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "zero_hpz_partition_size": _not(1),
    "zero_quantized_weights": in_use,
    "zero_quantized_nontrainable_weights": in_use,
    "zero_quantized_gradients": in_use,
    "zeropp_loco_param": in_use,
    "mics_hierarchical_params_gather": in_use,
    "zenflow": in_use,
}
GATHER_16BIT = ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                "stage3_gather_fp16_weights_on_model_save")  # zero_optimization's; the last: its deprecated name
_SAVE_16BIT = ("read by fz.deepspeed's engine.save_16bit_model and fz.hf's checkpoints (whether ZeRO-3 writes the "
               "weights there; fz.hf's save_model writes them at any setting)")
READ_ELSEWHERE = {  # keys no Spec field holds, which a shell reads from the config itself
    "dataloader_drop_last": "read by fz.deepspeed.initialize's training_data loader",
    **{f"zero_optimization.{k}": _SAVE_16BIT for k in GATHER_16BIT},
    "checkpoint.load_universal": "read by fz.deepspeed's engine.load_checkpoint (the tag latest_universal names)",
}


def gathers_16bit_on_save(cfg: dict) -> bool:
    """Whether a DeepSpeed config has ZeRO-3 gather the 16-bit weights on save (any of its names)."""
    zero = cfg.get("zero_optimization") or {}
    return isinstance(zero, dict) and any(bool(zero.get(k)) for k in GATHER_16BIT)
DATA_TYPES = {"grad_accum_dtype"}
OFFLOAD_KEYS = {
    "device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu", "ratio", "fast_init",
    "pipeline_read", "pipeline_write", "pipeline", "super_offload", "cpuadam_cores_perc",
}
OFFLOAD_DEVICES = ("none", "cpu", "nvme")

FP16_USED = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale"}
FP16_IGNORED = {"fused_mode", "type"}
FP16_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {"auto_cast": in_use, "fp16_master_weights_and_grads": in_use}
BF16_USED = {"enabled"}
BF16_IGNORED = {"immediate_grad_update", "check_grad_overflow", "accumulate_grads_via_hooks"}
BF16_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {"bf16_master_weights_and_grads": in_use,
                                                     "bf16_optimizer_states": in_use}

ACTIVATION_KEYS = {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                   "number_checkpoints", "synchronize_checkpoint_boundary", "profile"}
# Any of these set means the model uses activation checkpointing.
ACTIVATION_ENABLING = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                       "number_checkpoints")
TENSORBOARD_KEYS = {"enabled", "output_path", "job_name"}  # also csv_monitor's
COMM_DTYPES = ("fp32", "fp16", "bf16")
