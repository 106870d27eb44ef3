"""Spec.from_deepspeed: real configs load, batch sizes and offload sections are DeepSpeed's, every
error names its key, the world size comes from torch.distributed (the optimizer, scheduler, ZeRO and
precision sections, one by one: test_config_mapping.py).

Configs come from the seed articles (/work/shared/seeds), DeepSpeed's config-json page,
and Hugging Face Trainer templates (the "auto" style).
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fz
from fz.config import keys as K
from fz.config.optimizer import OPTIMIZERS, SCHEDULES
from fz.testing.spawn import run_ranks

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ds_config.json"
AUTO = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, micro_batch=4, grad_accum=2, clip_grad_norm=1.0,
            total_steps=1000, warmup_steps=100)

SEEDS = {
    # 001 (ZeRO-0 article): offload given as booleans, as older configs do.
    "seed_001_zero0": {"train_batch_size": 32, "gradient_accumulation_steps": 1,
                       "zero_optimization": {"stage": 0, "offload_optimizer": False, "offload_param": False,
                                             "overlap_comm": True}},
    # 002 (HF Trainer notes): the optimizer left to the Trainer with "auto".
    "seed_002_auto_optimizer": {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto",
                                                                          "eps": "auto", "weight_decay": "auto"}}},
}
DOCS = {  # deepspeed.ai/docs/config-json examples (placeholders such as [true|false] made concrete)
    "optimizer_adam": {"optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                                "weight_decay": 3e-7}}},
    "scheduler_warmup": {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                                      "warmup_num_steps": 1000}}},
    "fp16": {"fp16": {"enabled": True, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 16,
                      "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False,
                      "min_loss_scale": 1, "fp16_master_weights_and_grads": False}},
    "bf16": {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
    "zero": {"zero_optimization": {
        "stage": 3, "allgather_partitions": True, "allgather_bucket_size": 5e8, "compute_grad_norm": True,
        "overlap_comm": False, "reduce_scatter": True, "reduce_bucket_size": 5e8, "contiguous_gradients": True,
        "offload_param": {"device": "cpu", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 5,
                          "buffer_size": 1e8, "max_in_cpu": 1e9},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "ratio": 0.3,
                              "buffer_count": 4, "fast_init": False},
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 5e8,
        "stage3_param_persistence_threshold": 1e6, "sub_group_size": 1e9, "elastic_checkpoint": False,
        "stage3_gather_16bit_weights_on_model_save": False, "ignore_unused_parameters": True,
        "round_robin_gradients": False, "parameter_alignment": False, "zero_hpz_partition_size": 1,
        "zero_quantized_weights": False, "zero_quantized_gradients": False, "log_trace_cache_warnings": False}},
    "comm": {"communication_data_type": "fp32", "gradient_allreduce_op": "mean", "prescale_gradients": False,
             "gradient_predivide_factor": 1.0, "gradient_clipping": 1.0},
    "torch_autocast": {"torch_autocast": {"enabled": True, "dtype": "bfloat16",
                                          "lower_precision_safe_modules": ["torch.nn.Linear", "torch.nn.Conv2d"]}},
    "tensor_parallel": {"tensor_parallel": {"autotp_size": 4, "preset_model": "llama", "tp_overlap_comm": False,
                                            "partition_config": {"use_default_specs": False, "layer_specs": [
                                                {"patterns": [".*\\.o_proj\\.weight$"], "partition_type": "row"}]}}},
    "hybrid_engine": {"hybrid_engine": {"enabled": True, "max_out_tokens": 512, "inference_tp_size": 1,
                                        "release_inference_cache": False, "pin_parameters": True,
                                        "tp_gather_partition_size": 8, "enable_cuda_graph": False}},
    "expert_parallel": {"expert_parallel": {"enabled": True, "autoep_size": 4, "preset_model": "mixtral"}},
    "activation_checkpointing": {"activation_checkpointing": {
        "partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
        "number_checkpoints": None, "synchronize_checkpoint_boundary": False, "profile": False}},
    "data_efficiency": {"data_efficiency": {"enabled": True, "seed": 1234, "data_routing": {"enabled": True}}},
    "monitors": {"tensorboard": {"enabled": True, "output_path": "output/ds_logs/", "job_name": "train_bert"},
                 "wandb": {"enabled": True, "group": "my_group", "team": "my_team", "project": "my_project"},
                 "csv_monitor": {"enabled": True, "output_path": "output/ds_logs/", "job_name": "train_bert"},
                 "comet": {"enabled": True, "workspace": "my_workspace", "project": "my_project"}},
    "compile": {"zero_optimization": {"stage": 0}, "compile": {"deepcompile": True, "passes": ["autosp"]}},
    "internals": {  # aio, logging, autotuning, flops profiler, comms logger, checkpoint, data types
        "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
        "steps_per_print": 10, "wall_clock_breakdown": False, "dump_state": False, "disable_python_gc": False,
        "autotuning": {"enabled": False, "results_dir": "autotuning_results", "metric": "throughput", "fast": True},
        "flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1, "top_modules": 1,
                           "detailed": True, "output_file": None},
        "comms_logger": {"enabled": True, "verbose": False, "prof_all": False, "prof_ops": ["all_reduce"]},
        "checkpoint": {"tag_validation": "Warn", "load_universal": False, "parallel_write": {"pipeline_stage": False}},
        "data_types": {"grad_accum_dtype": "fp32"}},
    "batch": {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8},
}
HF = {  # Hugging Face Trainer templates: "auto" everywhere, filled from keywords
    "zero3_fp16": {
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                 "hysteresis": 2, "min_loss_scale": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto", "sub_group_size": 1e9,
                              "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                              "stage3_gather_16bit_weights_on_model_save": "auto"},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False},
    "zero3_bf16": {
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 0,
                              "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 0,
                              "stage3_max_reuse_distance": 0, "stage3_gather_16bit_weights_on_model_save": True},
        "bf16": {"enabled": True},
        "fp16": {"enabled": "auto", "auto_cast": False, "loss_scale": 0, "initial_scale_power": 32,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False},
}
ALL = {**SEEDS, **DOCS, **HF}


@pytest.mark.filterwarnings("ignore::fz.config.DeepSpeedConfigWarning")  # features fz lacks: tested elsewhere
@pytest.mark.parametrize("name", sorted(ALL))
def test_real_configs_load(name):
    keywords = {"zero3_fp16": "fp16", "zero3_bf16": "bf16", "seed_002_auto_optimizer": "bf16"}  # the "auto" ones
    kw = dict(AUTO, precision=keywords[name]) if name in keywords else {}  # a keyword must agree with the config
    if name == "zero":  # DeepSpeed's full example offloads 30% of the optimizer: refused, naming the key
        with pytest.raises(fz.ConfigError, match=r"offload_optimizer\.ratio=0\.3"):
            fz.Spec.from_deepspeed(ALL[name], **kw)
        return
    spec = fz.Spec.from_deepspeed(ALL[name], **kw)
    assert isinstance(spec, fz.Spec) and spec.provenance is not None
    assert "fz.Spec from DeepSpeed config" in spec.explain()


def test_offload_sections_map_to_a_policy():
    zero = copy.deepcopy(ALL["zero"])
    del zero["zero_optimization"]["offload_optimizer"]["ratio"]
    spec = fz.Spec.from_deepspeed(dict(zero, aio={"thread_count": 3, "queue_depth": 8}))
    assert spec.offload == fz.offload.Offload("disk", "host", "/local_nvme", True, buffer_mb=1e8 * 4 / 2**20,
                                              buffers=5, prefetch=2, io_threads=3)
    text = spec.explain()
    assert "aio.queue_depth" in text and "not libaio" in text and "max_in_cpu" in text
    stage2 = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    assert fz.Spec.from_deepspeed(stage2).offload == fz.offload.cpu()
    assert fz.Spec.from_deepspeed({"zero_optimization": {"stage": 2, "cpu_offload": True}}).offload == fz.offload.cpu()
    with pytest.warns(fz.config.DeepSpeedConfigWarning, match="offload_param has no effect at ZeRO stage 2"):
        assert fz.Spec.from_deepspeed({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}).offload \
            is None  # as DeepSpeed ignores it there
    with pytest.raises(fz.ConfigError, match="nvme_path.*missing|required key is missing"):
        fz.Spec.from_deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}})
    plain = fz.Spec.from_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {"device": "none"}}})
    assert plain.offload is None


def test_the_example_config_loads_from_its_path():
    spec = fz.Spec.from_deepspeed(EXAMPLE, world_size=2)
    assert (spec.stage, spec.micro_batch, spec.grad_accum, spec.precision) == (3, 8, 2, "bf16")
    assert fz.Monitor.settings_of(spec)["log_dir"] == "runs/train_ds_config" and spec.clip_grad_norm == 1.0
    assert fz.Spec.from_deepspeed(EXAMPLE.read_text(), world_size=2).stage == 3  # JSON text works too


MB, GA, BOTH = dict(micro_batch=4), dict(grad_accum=2), dict(micro_batch=4, grad_accum=2)


@pytest.mark.parametrize("sizes, world, kw, want", [
    (dict(train_batch_size=32, train_micro_batch_size_per_gpu=4), 2, {}, (4, 4, 32)),
    (dict(train_batch_size=32, gradient_accumulation_steps=2), 4, {}, (4, 2, 32)),
    (dict(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2), 2, {}, (4, 2, 16)),
    (dict(train_batch_size=32, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=4), 2, {}, (4, 4, 32)),
    (dict(train_batch_size=16), 2, {}, (8, 1, 16)),
    (dict(train_micro_batch_size_per_gpu=3), 4, {}, (3, 1, 12)),
    (dict(gradient_accumulation_steps=4), 2, {}, (None, 4, None)),
    ({}, 1, {}, (None, 1, None)),
    (dict(train_batch_size="auto", train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps=2), 2, MB,
     (4, 2, 16)),  # micro from micro_batch=4, train derived
    (dict(train_batch_size=12, train_micro_batch_size_per_gpu=3, gradient_accumulation_steps="auto"), 2, GA,
     (3, 2, 12)),  # "auto" accumulation filled from grad_accum=2 (and consistent)
    (dict(train_batch_size=24, train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps=3), 2, MB,
     (4, 3, 24)),
    (dict(train_batch_size=32), 2, MB, (4, 4, 32)),  # the keyword fills the absent micro size (not 32 / 2)
    (dict(gradient_accumulation_steps="auto"), 2, BOTH, (4, 2, 16)),  # absent micro, "auto" accumulation
    (dict(train_batch_size=24, gradient_accumulation_steps=3), 2, BOTH, None),  # grad_accum=2 contradicts 3
])
def test_batch_size_arithmetic(sizes, world, kw, want):
    if want is None:
        with pytest.raises(fz.ConfigError, match="gradient_accumulation_steps: the config says 3 but"):
            fz.Spec.from_deepspeed(sizes, world_size=world, **kw)
        return
    spec = fz.Spec.from_deepspeed(sizes, world_size=world, **kw)
    train = spec.provenance.get("train_batch_size", (None,))[0]
    assert (spec.micro_batch, spec.grad_accum, train) == want


@pytest.mark.parametrize("cfg, auto, match", [
    ({"zero_optimization": {"stage": 4}}, {}, r"^zero_optimization\.stage: 4 is not one of 0, 1, 2, 3$"),
    ({"zero_optimization": {"stage": "3"}}, {}, r'^zero_optimization\.stage: must be an integer, got the string "3"$'),
    ({"train_batch_sise": 8}, {}, r"train_batch_sise: unknown DeepSpeed key \(did you mean 'train_batch_size'\?\)"),
    ({"zero_optimization": {"overlap_com": True}}, {}, r"zero_optimization\.overlap_com: unknown .*'overlap_comm'"),
    ({"optimizer": {"type": "Adam", "params": {"beta": [0.9, 0.99]}}}, {}, r"optimizer\.params\.beta: .*'betas'"),
    ({"fp16": {"enabeld": True}}, {}, r"fp16\.enabeld: unknown DeepSpeed key \(did you mean 'enabled'\?\)"),
    ({"gradient_clipping": "1.0"}, {}, r"gradient_clipping: '1\.0' must be a number"),
    ({"gradient_clipping": -1}, {}, r"gradient_clipping: -1 must be >= 0"),
    ({"fp16": {"enabled": "yes"}}, {}, r"fp16\.enabled: 'yes' must be true or false"),
    ({"zero_optimization": [3]}, {}, r"zero_optimization: expected an object"),
    ({"train_micro_batch_size_per_gpu": 0}, {}, r"train_micro_batch_size_per_gpu: 0 must be >= 1"),
    ({"train_micro_batch_size_per_gpu": 2.5}, {}, r"train_micro_batch_size_per_gpu: must be an integer, got 2\.5"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}}, {},
     r"optimizer\.params\.betas\[1\]: 1\.5 must be < 1\.0"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, {}, r"fp16\.loss_scale_window: 0 must be >= 1"),
    ({"zero_optimization": {"reduce_bucket_size": 0}}, {}, r"zero_optimization\.reduce_bucket_size: 0 must be >= 1"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}, {},
     r"zero_optimization\.offload_optimizer\.device: 'gpu' is not one of none, cpu, nvme"),
    ({"communication_data_type": "fp8"}, {}, r"communication_data_type: 'fp8' is not one of fp32, fp16, bf16"),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     {"world_size": 2}, r"train_batch_size=32 != train_micro_batch_size_per_gpu=4 \* gradient_accumulation_steps=2 "
                        r"\* world_size=2 \(= 16\)"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, {"world_size": 2},
     r"train_batch_size=30, train_micro_batch_size_per_gpu=4 and world_size=2 give gradient_accumulation_steps=3\.75"),
    ({"train_batch_size": 7}, {"world_size": 2}, r"train_batch_size=7 is not divisible by world_size=2"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, {},
     r'optimizer\.params\.lr: "auto" is left without a value \(pass lr=\.\.\. to Spec\.from_deepspeed\)'),
    ({"train_micro_batch_size_per_gpu": "auto"}, {},
     r'train_micro_batch_size_per_gpu: "auto" is left without a value \(pass micro_batch=\.\.\.'),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}}, {},
     r'scheduler\.params\.total_num_steps: "auto" .*total_steps='),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": "auto", "cycle_max_lr": 1}}}, {},
     r'scheduler\.params\.cycle_min_lr: "auto" .*fz has no keyword'),
    ({"fp16": {"enabled": "auto"}}, {}, r'fp16\.enabled: "auto" .*precision='),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, {}, "fp16.enabled and bf16.enabled are both true"),
    ({"optimizer": {"type": "AdamX"}}, {}, r"optimizer\.type: 'AdamX' is not one of Adam, AdamW, Lamb, Lion, SGD, "
                                           r"Adafactor \(did you mean"),
    ({"optimizer": {"type": "Muon", "params": {"lr": 0.001}}}, {}, r"optimizer\.type: 'Muon' is not one of"),
    ({"optimizer": {"type": "SGD", "params": {"nesterov": True}}}, {}, r"optimizer\.params\.nesterov: true needs"),
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, {}, r"optimizer\.params\.amsgrad: true is not"),
    ({"optimizer": {"type": "Lamb", "params": {"max_grad_norm": 1.0}}}, {}, r"optimizer\.params\.max_grad_norm"),
    ({"scheduler": {"type": "WarmupLr"}}, {}, r"scheduler\.type: 'WarmupLr' is not one of .*did you mean 'WarmupLR'"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}}, {},
     r"scheduler\.params\.warmup_type: 'cubic' is not one of log, linear"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, {},
     r"scheduler\.params\.total_num_steps: required key is missing"),
    ({"tensorboard": {"enabled": True, "job_name": 3}}, {}, r"tensorboard\.job_name: 3 must be a string"),
    ({}, {"learning_rate": 1e-3}, r"unknown keyword 'learning_rate'"),
    ({}, {"warmup_step": 10}, r"unknown keyword 'warmup_step' \(did you mean 'warmup_steps'\?\)"),
    ({}, {"micro_batch": 0}, r"micro_batch: 0 must be >= 1"),
    ({}, {"precision": "fp8"}, r"precision: 'fp8' is not one of fp32, bf16, fp16"),
    ([1, 2], {}, r"Spec\.from_deepspeed needs a dict or a path"),
])
def test_errors_name_the_key(cfg, auto, match):
    with pytest.raises(fz.ConfigError, match=match):
        fz.Spec.from_deepspeed(cfg, **auto)


def test_file_errors(tmp_path):
    with pytest.raises(fz.ConfigError, match="cannot read DeepSpeed config"):
        fz.Spec.from_deepspeed(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,}')
    with pytest.raises(fz.ConfigError, match="is not valid JSON"):
        fz.Spec.from_deepspeed(bad)


def _dist_config(rank, world):
    from fz.testing.gpt import lm_loss

    from support.helpers import make_model, rank_batches
    out = {}
    spec = fz.Spec.from_deepspeed(EXAMPLE)  # the world size comes from torch.distributed
    out["sizes"] = (spec.micro_batch, spec.grad_accum, spec.provenance["world_size"])
    try:
        fz.Spec.from_deepspeed(EXAMPLE, world_size=4)
    except fz.ConfigError as e:
        out["mismatch"] = str(e)
    spec = fz.Spec.from_deepspeed({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
                                   "optimizer": {"type": "Lamb", "params": {"lr": 0.01}},
                                   "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}})
    state = fz.init(make_model(), spec.replace(loss_fn=lm_loss))
    losses = []
    for per_rank in rank_batches(world, 1, 4):
        state, loss = fz.train_step(state, per_rank[rank])
        losses.append(float(loss))
    out["losses"], out["lr"] = losses, fz.optim.current_lr(state.opt_state)
    return out


def test_world_size_from_torch_distributed():
    res = run_ranks(2, _dist_config, timeout=120)
    assert res[0]["sizes"] == (8, 2, (2, "auto")) and res[0] == res[1] | {"losses": res[0]["losses"]}
    assert "world_size=4 but torch.distributed runs 2 processes" in res[0]["mismatch"]
    assert res[0]["lr"] == pytest.approx(fz.optim.WarmupLR(warmup_max_lr=0.01, warmup_num_steps=3)(3))
    assert res[0]["losses"][-1] < res[0]["losses"][0]


# --- property: random configs give a Spec or a ConfigError, never anything else -----------------------------

NAMES = sorted(K.TOP_USED | K.TOP_IGNORED | set(K.TOP_UNSUPPORTED) | K.ZERO_USED | K.ZERO_IGNORED | K.OFFLOAD_KEYS
               | K.FP16_USED | K.ACTIVATION_KEYS | K.TENSORBOARD_KEYS | {k for v in OPTIMIZERS.values() for k in v[1]}
               | {t[0] for v in SCHEDULES.values() for t in v[1]} | {"type", "params", "device"})
WORDS = ["auto", "none", "cpu", "fp16", "bf16", "log", "linear"] + [v[0] for v in OPTIMIZERS.values()] + list(SCHEDULES)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 10), st.integers(), st.floats(), st.floats(0, 2),
                    st.sampled_from(WORDS), st.text(max_size=4))
KEYS = st.sampled_from(NAMES) | st.text(max_size=4)
VALUES = st.recursive(SCALARS, lambda x: st.lists(x, max_size=3) | st.dictionaries(KEYS, x, max_size=5), max_leaves=10)


def _section(names):
    return st.dictionaries(st.sampled_from(sorted(names)) | st.text(max_size=3), VALUES, max_size=6) | SCALARS


def _typed(types, keys_of):
    return st.sampled_from(types).flatmap(lambda t: st.fixed_dictionaries(
        {"type": st.just(t)}, optional={"params": _section(keys_of(t))}))


CONFIGS = st.dictionaries(KEYS, VALUES, max_size=8) | st.fixed_dictionaries({}, optional={
    **{k: SCALARS for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                            "gradient_clipping", "steps_per_print", "seed", "communication_data_type")},
    "zero_optimization": _section(K.ZERO_USED | K.ZERO_IGNORED | set(K.ZERO_UNSUPPORTED)),
    "fp16": _section(K.FP16_USED), "bf16": _section(K.BF16_USED),
    "activation_checkpointing": _section(K.ACTIVATION_KEYS), "tensorboard": _section(K.TENSORBOARD_KEYS),
    "optimizer": _typed([v[0] for v in OPTIMIZERS.values()] + ["nope"],
                        lambda t: OPTIMIZERS.get(t.lower(), ("", {"lr"}))[1]),
    "scheduler": _typed(list(SCHEDULES) + ["nope"],
                        lambda t: {x[0] for x in SCHEDULES.get(t, (None, []))[1]} | {"last_batch_iteration"}),
})
KWARGS = st.dictionaries(st.sampled_from(list(AUTO) + ["precision", "world_size", "bogus"]),
                         SCALARS | st.floats(0, 1) | st.tuples(st.floats(0, 0.99), st.floats(0, 0.99)), max_size=5)


@pytest.mark.filterwarnings("ignore::fz.config.DeepSpeedConfigWarning")
@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(CONFIGS, KWARGS)
def test_random_configs_raise_only_config_errors(cfg, kwargs):
    try:
        spec = fz.Spec.from_deepspeed(cfg, **kwargs)
    except fz.ConfigError:
        return
    assert isinstance(spec.explain(), str)


def test_every_spec_field_is_documented_and_enumerations_are_literals():
    """One field per line with its docstring under it (torchtitan's config style); enumerations
    are Literal types, and the values the checks accept are exactly the Literal's."""
    import ast
    import dataclasses
    import typing

    import fz.precision
    tree = ast.parse((Path(fz.__file__).parent / "spec.py").read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Spec").body
    documented = {a.target.id for a, b in zip(body, body[1:]) if isinstance(a, ast.AnnAssign)
                  and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)}
    assert documented == {f.name for f in dataclasses.fields(fz.Spec)}
    hints = typing.get_type_hints(fz.Spec)
    assert typing.get_args(hints["stage"]) == (0, 1, 2, 3)
    assert set(typing.get_args(hints["precision"])) == set(fz.precision.PRECISIONS)
    assert set(typing.get_args(hints["nonfinite"])) == {"skip", "raise"}
    assert set(typing.get_args(hints["buffer_sync"])) == {"mean", "rank0", "local"}
    for field, bad in (("precision", "fp8"), ("nonfinite", "ignore"), ("buffer_sync", "max"), ("stage", 4)):
        with pytest.raises(fz.ConfigError, match=rf"^Spec\.{field}="):
            fz.Spec(**{field: bad})
    with pytest.raises(TypeError):
        fz.Spec(2)  # keyword-only
