"""Every key of a DeepSpeed config shows once in explain() with its outcome, and the batch
arithmetic holds, for every config the loader accepts (real ones and generated ones); the
worked example of docs/deepspeed-config.md (transformers' ds_config_zero3.json) prints what that page shows.
"""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fz
from fz.config.explain import KEYS_HEADER

ROOT = Path(__file__).resolve().parents[2]
ZERO3 = ROOT / "tests" / "data" / "ds_config_zero3.json"  # transformers' tests/deepspeed/ds_config_zero3.json
OUTCOMES = ("mapped", "auto", "ignored", "unsupported")
SECTIONS = {"zero_optimization", "fp16", "bf16", "bfloat16", "optimizer", "optimizer.params", "scheduler",
            "scheduler.params", "activation_checkpointing", "tensorboard", "zero_optimization.offload_optimizer",
            "zero_optimization.offload_param", "aio"}  # fz reads these key by key
TRAINER = dict(lr=5e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, micro_batch=8, grad_accum=1,
               clip_grad_norm=1.0, precision="bf16", total_steps=1000, warmup_steps=0, hidden_size=768)

REAL = {  # as published (LLaMA-Factory ds_z3_config, Megatron-DeepSpeed, a DeepSpeed-Chat style dict, ...)
    "transformers_zero3": (json.loads(ZERO3.read_text()), TRAINER),
    "llama_factory_z3": ({
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                 "hysteresis": 2, "min_loss_scale": 1},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "overlap_comm": False, "contiguous_gradients": True, "sub_group_size": 1e9,
                              "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                              "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}},
        TRAINER),
    "megatron_deepspeed": ({
        "train_batch_size": 256, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
        "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "prescale_gradients": False,
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1,
                 "initial_scale_power": 11}, "wall_clock_breakdown": False}, dict(world_size=8)),
    "deepspeed_chat": ({
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "none"}, "offload_optimizer": {"device": "none"},
                              "stage3_param_persistence_threshold": 1e4, "stage3_max_live_parameters": 3e7,
                              "stage3_prefetch_bucket_size": 3e7, "memory_efficient_linear": False},
        "fp16": {"enabled": True, "loss_scale_window": 100}, "gradient_clipping": 1.0, "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1},
        "tensorboard": {"enabled": False, "output_path": "step1_tensorboard/ds_tensorboard_logs/",
                        "job_name": "step1_model_tensorboard"}}, dict(world_size=8)),
    "warmup_lr_with_comments": ({
        "_comment": "stage 2, no offload", "zero_allow_untested_optimizer": True,
        "scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": -1, "warmup_min_lr": 0,
                                                     "warmup_max_lr": 1e-4, "warmup_num_steps": 10000}},
        "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True,
                              "allgather_bucket_size": 2e8, "reduce_bucket_size": 2e8},
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                 "hysteresis": 2, "min_loss_scale": 1},
        "steps_per_print": 100, "train_micro_batch_size_per_gpu": 8,
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                     "contiguous_memory_optimization": False, "number_checkpoints": False,
                                     "synchronize_checkpoint_boundary": False, "profile": False}}, {}),
    "example": (json.loads((ROOT / "examples" / "ds_config.json").read_text()), dict(world_size=2)),
}


def leaves(cfg, prefix=""):
    """The input's keys at the granularity fz reports: sections it reads are opened."""
    for k, v in cfg.items():
        path = f"{prefix}.{k}" if prefix else k
        if path in SECTIONS and isinstance(v, dict) and v:
            yield from leaves(v, path)
        else:
            yield path


def ledger(text):
    lines = text.splitlines()
    start = lines.index(KEYS_HEADER) + 1
    rows = []
    for line in lines[start:]:
        if not line.startswith("  "):
            break
        rows.append(tuple(line.split()[:2]))
    return rows


def check(cfg, spec):
    rows = ledger(spec.explain())
    paths = [p for p, _ in rows]
    want = list(leaves(cfg))
    for leaf in want:
        assert paths.count(leaf) == 1, (leaf, rows)
    for path, outcome in rows:
        assert outcome in OUTCOMES, (path, outcome)
        assert path in want or outcome == "unsupported", (path, outcome)  # e.g. OneCycle's default momentum
    if spec.micro_batch is not None:
        world, train = spec.provenance["world_size"][0], spec.provenance["train_batch_size"][0]
        assert spec.micro_batch * spec.grad_accum * world == train


def quiet_load(cfg, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fz.Spec.from_deepspeed(cfg, **kw)


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_configs_account_for_every_key(name):
    cfg, kw = REAL[name]
    check(cfg, quiet_load(cfg, **kw))


def test_explain_lists_values_sources_and_each_key_once():
    cfg = dict(json.loads(ZERO3.read_text()), tensorboard={"enabled": False}, amp={"enabled": True, "opt_level": "O1"})
    kw = {k: v for k, v in TRAINER.items() if k != "hidden_size"}
    with pytest.warns(fz.config.DeepSpeedConfigWarning, match="amp"):
        spec = fz.Spec.from_deepspeed(cfg, world_size=2, **kw)
    lines = spec.explain().splitlines()
    keys_at = lines.index(KEYS_HEADER)
    row = {ln.split()[0]: ln.split() for ln in lines[2:keys_at]}
    assert row["stage"][1:3] == ["config", "zero_optimization.stage"]
    assert row["micro_batch"][1] == "auto" and row["micro_batch"][-1] == "8"
    assert row["optimizer.lr"][1] == "auto" and row["world_size"][1] == "auto" and row["world_size"][-1] == "2"
    assert row["bucket_mb"][1] == "default" and '("auto")' in row["bucket_mb"]  # no hidden_size: fz's default
    assert row["precision"][1:3] == ["auto", "precision="] and row["wrap"][1] == "default"
    keys = [ln.split(None, 2) for ln in lines[keys_at + 1:] if ln.startswith("  ")]
    outcome = {k[0]: k[1:] for k in keys}
    assert [k[0] for k in keys].count("zero_optimization.overlap_comm") == 1
    assert outcome["zero_optimization.overlap_comm"] == ["ignored"] and outcome["wall_clock_breakdown"] == ["ignored"]
    assert outcome["zero_optimization.offload_optimizer.device"] == ["mapped"]
    assert spec.offload == fz.offload.cpu(params=True)  # both sections: device cpu, pinned
    assert outcome["amp"] == ["unsupported"] and outcome["fp16.loss_scale"] == ["ignored", "fp16 is off"]
    assert outcome["optimizer.params.lr"] == ["auto", "lr=5e-05"] and outcome["tensorboard.enabled"] == ["mapped"]
    assert spec.provenance.unused_auto == ["total_steps"]  # WarmupLR has no total
    assert all(src in ("config", "auto", "default") for _, (_, src) in spec.provenance.items())
    changed = spec.replace(stage=1, offload=None)
    assert "(changed after from_deepspeed)" in next(ln for ln in changed.explain().splitlines()
                                                    if ln.startswith("stage "))
    assert changed == spec.replace(stage=1, offload=None, provenance=None)  # provenance stays out of ==


# --- property: any accepted config ------------------------------------------------------------------------

def opt(values):
    return st.sampled_from(values)


SIZES = opt(["auto", 1, 2, 4, 8, 16, 32, 64])
ZERO = st.fixed_dictionaries({}, optional={
    "stage": opt([0, 1, 2, 3]), "reduce_bucket_size": opt(["auto", 2**16, 5e8]),
    "allgather_bucket_size": opt([2**15, 5e8]), "stage3_prefetch_bucket_size": opt(["auto", 0, 2**15, 5e7]),
    "prefetch_bucket_size": opt([2**16]), "stage3_param_persistence_threshold": opt(["auto", 0, 1e4]),
    "param_persistence_threshold": opt([10]), "stage3_max_live_parameters": opt([1e9, 0]),
    "overlap_comm": st.booleans(), "sub_group_size": opt([1e9]), "cpu_offload": st.booleans(),
    "offload_optimizer": opt([False, True, {"device": "none"}, {"device": "cpu", "pin_memory": True}]),
    "offload_param": opt([{"device": "nvme", "nvme_path": "/nvme"}, {"device": "none"}]),
    "zero_quantized_weights": st.booleans(), "mics_shard_size": opt([-1, 2]),
    "stage3_gather_16bit_weights_on_model_save": opt([True, "auto"])}) | opt([True, False, None, {}])
FP16 = st.fixed_dictionaries({}, optional={"enabled": opt([True, False, "auto", None]), "loss_scale": opt([0, 128]),
                                           "initial_scale_power": opt([16, 32]), "auto_cast": st.booleans()})
BF16 = st.fixed_dictionaries({}, optional={"enabled": opt([True, False, "auto"])})
PARAMS = st.fixed_dictionaries({}, optional={
    "lr": opt(["auto", 1e-3, 5e-5]), "betas": opt(["auto", [0.9, 0.95], [0.9, 0.999]]), "eps": opt(["auto", 1e-8]),
    "weight_decay": opt(["auto", 0.0, 0.1]), "bias_correction": st.booleans()})
OPTIMIZER = st.fixed_dictionaries({"type": opt(["Adam", "AdamW", "Lamb"])}, optional={"params": PARAMS}) | opt([{}])
SCHEDULER = st.fixed_dictionaries({"type": opt(["WarmupLR", "WarmupDecayLR"])}, optional={
    "params": st.fixed_dictionaries({}, optional={
        "warmup_num_steps": opt(["auto", 0, 10]), "warmup_min_lr": opt(["auto", 0]),
        "warmup_max_lr": opt(["auto", 1e-3]), "total_num_steps": opt(["auto", 5, 100])})}) | opt([
    {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}, {}])
CONFIGS = st.fixed_dictionaries({}, optional={
    "train_batch_size": SIZES, "train_micro_batch_size_per_gpu": SIZES, "gradient_accumulation_steps": SIZES,
    "gradient_clipping": opt(["auto", 0, 1.0, None]), "steps_per_print": opt(["auto", 10]),
    "zero_optimization": ZERO, "fp16": FP16 | st.none(), "bf16": BF16, "bfloat16": BF16, "optimizer": OPTIMIZER,
    "scheduler": SCHEDULER, "wall_clock_breakdown": st.booleans(), "_comment": st.text(max_size=5),
    "comms_config": opt([{"verbose": False}]), "curriculum_learning": opt([{"enabled": True}, {"enabled": False}]),
    "activation_checkpointing": st.fixed_dictionaries({}, optional={
        "partition_activations": st.booleans(), "cpu_checkpointing": st.booleans(),
        "number_checkpoints": opt([None, 2, False]), "profile": st.booleans()}),
    "tensorboard": st.fixed_dictionaries({}, optional={"enabled": st.booleans(), "output_path": opt(["runs"])}),
})
KEYWORDS = st.fixed_dictionaries({}, optional={
    "lr": opt([1e-3, 2e-5]), "betas": opt([(0.9, 0.999)]), "eps": opt([1e-8]), "weight_decay": opt([0.0, 0.1]),
    "micro_batch": opt([1, 2, 4, 8]), "grad_accum": opt([1, 2, 4]), "clip_grad_norm": opt([0.0, 1.0, None]),
    "precision": opt(["fp32", "bf16", "fp16"]), "total_steps": opt([50, 100]), "warmup_steps": opt([0, 10]),
    "hidden_size": opt([64]), "world_size": opt([1, 2, 4])})


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(CONFIGS, KEYWORDS)
def test_any_accepted_config_accounts_for_every_key_and_its_batch_sizes(cfg, kw):
    try:
        spec = quiet_load(cfg, **kw)
    except fz.ConfigError:
        return
    check(cfg, spec)


# --- docs/deepspeed-config.md's worked example ---------------------------------------------------------------

def test_docs_worked_example_prints_what_the_page_shows(capsys, monkeypatch):
    text = (ROOT / "docs" / "deepspeed-config.md").read_text()
    at = text.index('"tests/data/ds_config_zero3.json"')
    code = re.search(r"```python\n(.*?)```", text[text.rindex("```python", 0, at):], re.S).group(1)
    shown = re.search(r"```text\n(.*?)```", text[at:], re.S).group(1)
    monkeypatch.chdir(ROOT)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fz.config.DeepSpeedConfigWarning)  # everything in it is honoured
        exec(compile(code, "docs/deepspeed-config.md", "exec"), {})
    assert capsys.readouterr().out == shown


def test_grad_accum_dtype_is_honoured_as_fz_accumulates_and_warned_otherwise():
    """fz keeps a gradient between micro-batches in the compute dtype, DeepSpeed's default."""
    for precision, dtype in (("bf16", "bf16"), ("fp32", "fp32")):
        cfg = {"train_batch_size": 8, "data_types": {"grad_accum_dtype": dtype}}
        if precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        outcome, note = fz.Spec.from_deepspeed(cfg, world_size=1).provenance.outcomes["data_types.grad_accum_dtype"]
        assert outcome == "mapped" and note == f"fz accumulates gradients between micro-batches in {precision}", note
    cfg = {"train_batch_size": 8, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
    with pytest.warns(fz.config.DeepSpeedConfigWarning, match="data_types.grad_accum_dtype"):
        spec = fz.Spec.from_deepspeed(cfg, world_size=1)
    assert spec.provenance.outcomes["data_types.grad_accum_dtype"][0] == "unsupported"
    offloaded = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}  # fp32, on the host
    spec = fz.Spec.from_deepspeed({**cfg, **offloaded}, world_size=1)
    assert spec.provenance.outcomes["data_types.grad_accum_dtype"][0] == "mapped"
    with pytest.warns(fz.config.DeepSpeedConfigWarning, match=r"data_types.grad_accum_dtype \(fz accumulates "
                                                              r"gradients between micro-batches in fp32, not bf16\)"):
        fz.Spec.from_deepspeed({**cfg, **offloaded, "data_types": {"grad_accum_dtype": "bf16"}}, world_size=1)
    with pytest.raises(fz.ConfigError, match="data_types.grad_accum_dtyp: unknown DeepSpeed key"):
        fz.Spec.from_deepspeed({"train_batch_size": 8, "data_types": {"grad_accum_dtyp": "fp32"}}, world_size=1)


def test_a_key_a_shell_reads_is_not_called_ignored():
    cfg = {"train_batch_size": 8, "dataloader_drop_last": True}
    outcome, note = fz.Spec.from_deepspeed(cfg, world_size=1).provenance.outcomes["dataloader_drop_last"]
    assert outcome == "mapped" and "training_data loader" in note, (outcome, note)


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_param_below_stage_3_is_ignored_with_a_warning_as_deepspeed_ignores_it(stage):
    """DeepSpeed trains such a config (offload_param has no effect below ZeRO-3); fz refused it,
    saying DeepSpeed had the same rule."""
    zero = {"stage": stage, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    with pytest.warns(fz.config.DeepSpeedConfigWarning, match=rf"offload_param has no effect at ZeRO stage {stage}"):
        spec = fz.Spec.from_deepspeed({"train_batch_size": 8, "zero_optimization": zero}, world_size=1)
    assert (spec.offload.optimizer, spec.offload.params) == ("host", "device")
    assert spec.provenance.outcomes["zero_optimization.offload_param.device"][0] == "ignored"
    zero = {"stage": stage, "offload_param": {"device": "cpu", "pin_memory": False},
            "offload_optimizer": {"device": "cpu", "pin_memory": True}}  # none of offload_param's settings either
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        spec = fz.Spec.from_deepspeed({"train_batch_size": 8, "zero_optimization": zero}, world_size=1)
    assert spec.offload.pin_memory and not any("pin_memory" in str(w.message) for w in said)


@pytest.mark.parametrize("opt, par, said", [
    ({"pin_memory": True}, {"pin_memory": False}, r"offload_optimizer.pin_memory and offload_param.pin_memory differ "
                                                  r"\(True and False\): fz has one pin_memory for both tiers and "
                                                  "takes false"),
    ({"buffer_count": 4}, {"buffer_count": 8}, "buffer_count differ .*takes the larger"),
    ({}, {"max_in_cpu": 1e8}, r"offload_param.max_in_cpu=100000000.0 has no effect: fz keeps no parameters in host "
                              "memory between uses"),
])
def test_offload_settings_fz_merges_or_cannot_honour_are_warned(tmp_path, opt, par, said):
    """Both sections set what fz has one of (DeepSpeed keeps one per tier), or a host cache fz does not
    have is sized: merged or dropped silently before (explain() alone listed them)."""
    disk = {"device": "nvme", "nvme_path": str(tmp_path)}
    zero = {"stage": 3, "offload_optimizer": {**disk, **opt}, "offload_param": {**disk, **par}}
    with pytest.warns(fz.config.DeepSpeedConfigWarning, match=said):
        fz.Spec.from_deepspeed({"train_batch_size": 8, "zero_optimization": zero}, world_size=1)


def test_offload_settings_at_deepspeeds_defaults_warn_nothing(tmp_path):
    disk = {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True, "buffer_count": 5}
    zero = {"stage": 3, "offload_optimizer": disk, "offload_param": {**disk, "max_in_cpu": 1e9}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fz.Spec.from_deepspeed({"train_batch_size": 8, "zero_optimization": zero}, world_size=1)
