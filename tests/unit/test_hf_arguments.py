"""fz.hf.arguments (issue 23): TrainingArguments -> fz.Spec, against transformers' own code.

The "auto" fill is compared with transformers' HfTrainerDeepSpeedConfig on the same arguments
(deepspeed is not installed here, so TrainingArguments(deepspeed=...) refuses to build: the
tests set `args.deepspeed` after construction, and build HfTrainerDeepSpeedConfig on
accelerate's HfDeepSpeedConfig, the base it has when deepspeed is installed); then the
mismatches, spec=, the settings fz cannot honour. Optimizers compared update by update with the
torch optimizer Trainer.create_optimizer builds, schedules step by step with
transformers.get_scheduler: test_hf_arguments_optim.py. Single process, CPU; bf16=True /
fp16=True with use_cpu=True are accepted by TrainingArguments 5.x (nothing runs in half precision
here).
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
accelerate_ds = pytest.importorskip("accelerate.utils.deepspeed")

from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig  # noqa: E402

import fz  # noqa: E402
from fz.config import DeepSpeedConfigWarning  # noqa: E402
from fz.hf.arguments import spec_from_args, unsupported  # noqa: E402
from fz.hf.optimizers import OPTIMIZERS  # noqa: E402

from support.helpers import transform_updates as updates  # noqa: E402
from support.hf_args import STEPS, Tiny, make_args, quiet  # noqa: E402

ZERO3 = Path(__file__).resolve().parents[1] / "data" / "ds_config_zero3.json"


def hf_fill(cfg, args, model, steps):
    """transformers' own fill: trainer_config_process + trainer_config_finalize; the filled dict."""
    class Fill(HfTrainerDeepSpeedConfig, accelerate_ds.HfDeepSpeedConfig):
        pass
    hf = Fill.__new__(Fill)
    accelerate_ds.HfDeepSpeedConfig.__init__(hf, copy.deepcopy(cfg))
    hf._dtype, hf.mismatches = None, []
    hf.trainer_config_process(args)
    hf.trainer_config_finalize(args, model, steps)
    return hf.config


# --- every "auto" key, as transformers fills it ---------------------------------------------------------------

AUTO_TOP = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto"}
SECTIONS = {
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
}
CONFIGS = {
    "zero3_transformers_test": (json.loads(ZERO3.read_text()), dict(fp16=True)),
    "stage2_bf16_sections": ({**AUTO_TOP, **SECTIONS, "bf16": {"enabled": "auto"},
                              "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, dict(bf16=True)),
    "stage3_fp32_no_sections": ({**AUTO_TOP, "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
                                 "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                       "stage3_prefetch_bucket_size": "auto",
                                                       "stage3_param_persistence_threshold": "auto"}}, {}),
    "stage2_fp16_optimizer_only": ({**AUTO_TOP, "optimizer": SECTIONS["optimizer"], "fp16": {"enabled": "auto"},
                                    "zero_optimization": {"stage": 2}}, dict(fp16=True)),
    "stage3_scheduler_only": ({**AUTO_TOP, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": 3}}, dict(warmup_steps=0.25)),
}
FIELDS = ("stage", "micro_batch", "grad_accum", "clip_grad_norm", "precision", "bucket_mb", "persist_threshold",
          "prefetch", "live_buckets", "offload", "loss_scaling")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_auto_key_is_filled_as_transformers_fills_it(name, tmp_path):
    cfg, extra = CONFIGS[name]
    args = make_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=0.5,
                     learning_rate=3e-4, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, weight_decay=0.1,
                     warmup_steps=extra.pop("warmup_steps", 3), seed=7, deepspeed=cfg, **extra)
    model = Tiny()
    filled = hf_fill(cfg, args, model, STEPS)
    spec = quiet(spec_from_args, args, model, max_steps=STEPS)
    ref = quiet(fz.Spec.from_deepspeed, filled, world_size=1)  # the filled config, nothing left to fill
    assert {f: getattr(spec, f) for f in FIELDS} == {f: getattr(ref, f) for f in FIELDS}
    prov = spec.provenance
    names = {"train_micro_batch_size_per_gpu": "micro_batch", "gradient_accumulation_steps": "grad_accum",
             "train_batch_size": "train_batch_size", "gradient_clipping": "clip_grad_norm"}
    for key, field in names.items():
        if cfg.get(key) == "auto":
            assert prov[field][0] == filled[key], key
    for section in ("optimizer", "scheduler"):
        for key, value in cfg.get(section, {}).get("params", {}).items():
            if value == "auto":
                assert prov[f"{section}.{key}"][0] == pytest.approx(filled[section]["params"][key]), key
    for section in ("fp16", "bf16"):
        if cfg.get(section, {}).get("enabled") == "auto":
            assert (spec.precision == section) is filled[section]["enabled"]
    if "scheduler" in cfg:  # DeepSpeed's schedule from the filled values, step by step
        lr, want = prov["scheduler"][0], ref.provenance["scheduler"][0]
        assert [lr(k) for k in range(STEPS)] == [want(k) for k in range(STEPS)]
    if "optimizer" in cfg and "scheduler" in cfg:  # (without a scheduler section: the Trainer's, tested below)
        torch.testing.assert_close(updates(spec.optimizer), updates(ref.optimizer), rtol=0, atol=0)
    assert spec.seed == 7  # no "seed" key: TrainingArguments.seed


def test_explain_names_the_training_arguments(tmp_path):
    cfg = CONFIGS["stage2_bf16_sections"][0]
    spec = quiet(spec_from_args, make_args(tmp_path, bf16=True, per_device_train_batch_size=4, deepspeed=cfg),
                 Tiny(), max_steps=STEPS)
    text = spec.explain()
    for note in ("TrainingArguments.per_device_train_batch_size=4", "TrainingArguments.learning_rate=5e-05",
                 "TrainingArguments.max_grad_norm=1.0", "TrainingArguments.bf16/fp16='bf16'",
                 "TrainingArguments.adam_beta1/adam_beta2=(0.9, 0.999)", "max_steps=20", "TrainingArguments.seed",
                 "max(1, TrainingArguments.warmup_steps)=1"):  # warmup_steps=0, filled as transformers fills it
        assert note in text, note
    assert not re.search(r"\b(keyword|micro_batch=|lr=5e-05)", text) and "had no use for" not in text
    seeded = quiet(spec_from_args, make_args(tmp_path, gradient_checkpointing=True, deepspeed={**cfg, "seed": 3}),
                   Tiny(), max_steps=STEPS)
    assert (seeded.seed, seeded.activation_checkpointing) == (3, True)  # the config's seed wins, as DeepSpeed's
    assert re.search(r"^activation_checkpointing +args +TrainingArguments.gradient_checkpointing",
                     seeded.explain(), re.M)
    plain = spec_from_args(make_args(tmp_path, gradient_checkpointing=True), Tiny(), max_steps=STEPS)
    rows = {ln.split()[0]: ln.split()[1:3] for ln in plain.explain().splitlines()[2:]}
    assert plain.explain().splitlines()[0] == "fz.Spec from TrainingArguments"
    assert rows["micro_batch"] == ["args", "TrainingArguments.per_device_train_batch_size"]
    assert rows["activation_checkpointing"] == ["args", "TrainingArguments.gradient_checkpointing"]
    assert rows["optimizer.lr"] == ["args", "TrainingArguments.learning_rate"]
    assert rows["seed"] == ["args", "TrainingArguments.seed"] and plain.seed == 42
    assert (plain.stage, plain.activation_checkpointing, plain.clip_grad_norm) == (0, True, 1.0)


# --- mismatches: one error listing each, the keys transformers checks -----------------------------------------

def test_every_mismatch_in_one_error_as_transformers_lists_them(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "train_batch_size": 64,
           "gradient_clipping": 2.0, "fp16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-6,
                                                     "weight_decay": 0.1}},
           "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 7,
                                                             "total_num_steps": 99}}}
    args = make_args(tmp_path, per_device_train_batch_size=8, deepspeed=cfg)
    with pytest.raises(ValueError) as theirs:
        hf_fill(cfg, args, Tiny(), STEPS)
    keys = re.findall(r"^- ds (\S+?)=", str(theirs.value), re.M)
    assert len(keys) == 12
    with pytest.raises(fz.ConfigError) as ours:
        spec_from_args(args, Tiny(), max_steps=STEPS)
    assert re.findall(r"^- (\S+?)=", str(ours.value), re.M) == keys
    assert "- train_micro_batch_size_per_gpu=2 in the DeepSpeed config vs TrainingArguments " \
           "per_device_train_batch_size=8" in str(ours.value)


# --- spec= and the settings fz cannot honour -------------------------------------------------------------------

def test_spec_is_the_zero_setup_and_the_arguments_the_training(tmp_path):
    args = make_args(tmp_path, per_device_train_batch_size=4, bf16=True)
    spec = spec_from_args(args, Tiny(), max_steps=5, spec=fz.Spec(stage=3, bucket_mb=1.0))
    assert (spec.stage, spec.bucket_mb, spec.micro_batch, spec.precision) == (3, 1.0, 4, "bf16")
    with pytest.raises(fz.ConfigError, match=r"(?s)spec.micro_batch=2 vs TrainingArguments.per_device_train_batch"
                                             r"_size=4.*spec.precision='fp16' vs .*spec.optimizer is set"):
        spec_from_args(args, Tiny(), max_steps=5,
                       spec=fz.Spec(micro_batch=2, precision="fp16", optimizer=fz.optim.sgd(lr=0.1)))
    args.deepspeed = {"zero_optimization": {"stage": 2}}
    with pytest.raises(fz.ConfigError, match="TrainingArguments.deepspeed and spec= are both given"):
        spec_from_args(args, Tiny(), max_steps=5, spec=fz.Spec(stage=3))


def test_unsupported_names_every_setting_at_once(tmp_path):
    unsupported(make_args(tmp_path), Tiny())  # the defaults: nothing
    args = make_args(tmp_path)
    bad = dict(torch_compile=True, fsdp="full_shard", use_liger_kernel=True,
               auto_find_batch_size=True, fp16_full_eval=True, ddp_backend="ccl",
               optim="adagrad", lr_scheduler_type="inverse_sqrt", lr_scheduler_kwargs={"timescale": 3},
               deepspeed={"zero_optimization": {"stage": 2}})
    for k, v in bad.items():
        setattr(args, k, v)  # as they are after TrainingArguments' own checks (some need packages absent here)
    with pytest.raises(fz.ConfigError) as e:
        unsupported(args, Tiny(), spec=fz.Spec(stage=3))
    text = str(e.value)
    for k in bad:
        assert re.search(rf"^- {k}[=:]", text, re.M) or (k == "deepspeed" and "deepspeed= together with spec=" in
                                                          text), k
    assert "supported: adafactor, adamw" in text and "lion_32bit, sgd" in text
    assert sorted(OPTIMIZERS) == ["adafactor", "adamw", "adamw_hf", "adamw_torch", "adamw_torch_fused", "lion",
                                  "lion_32bit", "sgd"]
    with pytest.raises(fz.ConfigError, match=r"optim='adagrad': fz has no such optimizer"):
        spec_from_args(args, Tiny(), max_steps=5)


def test_accelerator_config_that_reads_other_samples_is_refused_naming_each_field(tmp_path):
    from transformers.trainer_pt_utils import AcceleratorConfig
    args = make_args(tmp_path)
    args.accelerator_config = AcceleratorConfig(non_blocking=True)  # changes no sample: accepted
    unsupported(args, Tiny())
    args.accelerator_config = AcceleratorConfig(split_batches=True, even_batches=False, use_seedable_sampler=False)
    with pytest.raises(fz.ConfigError) as e:
        unsupported(args, Tiny())
    text = str(e.value)
    assert "- accelerator_config.split_batches=True: each rank reads per_device_train_batch_size samples" in text
    assert "- accelerator_config.even_batches=False: an epoch's last micro-batch is filled up" in text
    assert "- accelerator_config.use_seedable_sampler=False: the order is accelerate's seedable sampler's" in text


# --- FastChat's config: a misspelt "auto" key warns ----------------------------------------------------------

FASTCHAT_S3 = {
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}, "micro_batch_size_per_gpu": "auto",
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "train_batch_size": "auto",
}


def test_fastchats_config_loads_with_a_warning(tmp_path):
    args = make_args(tmp_path, bf16=True, per_device_train_batch_size=2, gradient_accumulation_steps=16,
                     deepspeed=FASTCHAT_S3)
    with pytest.warns(DeepSpeedConfigWarning, match=r"micro_batch_size_per_gpu: .*'train_micro_batch_size_per_gpu'"):
        spec = spec_from_args(args, Tiny(), max_steps=STEPS)
    filled = hf_fill(FASTCHAT_S3, args, Tiny(), STEPS)
    assert filled["micro_batch_size_per_gpu"] == "auto"  # transformers leaves it too
    assert (spec.stage, spec.micro_batch, spec.grad_accum, spec.precision, spec.clip_grad_norm) == (
        3, filled["train_micro_batch_size_per_gpu"], filled["gradient_accumulation_steps"], "bf16",
        filled["gradient_clipping"])


def test_the_trainer_names_every_setting_it_cannot_honour_at_construction(tmp_path):
    """One error from fz.hf.Trainer(...), before any training: the Trainer's own refusals and
    the arguments' together, each with its reason."""
    pytest.importorskip("accelerate")
    import fz.hf

    from support.hf_trainer_jobs import Tokens, arguments, gpt2
    args = arguments(str(tmp_path), True, torch_compile=True, train_sampling_strategy="batch_rebalance",
                     optim="adamw_8bit")
    with pytest.raises(fz.ConfigError) as e:
        fz.hf.Trainer(model=gpt2(), args=args, train_dataset=Tokens(), eval_dataset=Tokens(8))
    lines = str(e.value).splitlines()
    assert lines[0] == "fz.hf.Trainer cannot honour these settings (remove them or set them to their defaults):"
    named = [line.split(":")[0] for line in lines[1:]]
    assert named == ["- train_sampling_strategy='batch_rebalance'", "- torch_compile=True",
                     "- torch_compile_backend='inductor'", "- optim='adamw_8bit'"], lines


@pytest.mark.slow  # a launcher end to end: torchrun, two processes importing transformers
def test_processes_launched_together_without_use_cpu_on_a_cpu_machine_name_the_fix(tmp_path):
    """Under torchrun on a machine without a GPU, transformers sets each process up alone unless
    use_cpu=True: fz.hf says so at once instead of training each on the same data."""
    import os
    import subprocess
    import sys
    if torch.cuda.is_available():
        pytest.skip("a GPU: transformers sets the processes up together")
    script = tmp_path / "train.py"
    script.write_text("import fz.hf\nfz.hf.TrainingArguments(output_dir='unused', report_to=[])\n")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    done = subprocess.run(torchrun, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode != 0
    assert "use_cpu=True (--use_cpu)" in done.stderr and "started 2 processes" in done.stderr, done.stderr[-2000:]


def test_a_deepspeed_config_fz_cannot_read_is_refused_when_the_arguments_are_made(tmp_path, recwarn):
    """transformers reads `deepspeed=` when the arguments are made; fz checks there all that needs no
    model nor data, so a TRL script fails before it tokenizes its data. Warnings wait for the Trainer."""
    def made(config, **kw):
        return fz.hf.TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], deepspeed=config, **kw)

    base = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 500, "warmup_num_steps": "auto"}}}
    for config, says in (
            (str(tmp_path / "missing.json"), r"cannot read DeepSpeed config .*missing\.json"),
            ({**base, "zero_optimization": {"stage": "2"}}, r'zero_optimization\.stage: must be an integer'),
            ({**base, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sz": 1}},
             r"unknown DeepSpeed key \(did you mean 'stage3_prefetch_bucket_size'\?\)"),
            ({**base, "train_micro_batch_size_per_gpu": 8}, r"contradicts TrainingArguments:\n- "
                                                            r"train_micro_batch_size_per_gpu=8")):
        with pytest.raises(fz.ConfigError, match=says):
            made(config, per_device_train_batch_size=4)
    # the steps come from the data: an explicit total is not compared yet, and nothing is warned twice
    args = made({**base, "amp": {"enabled": True}}, per_device_train_batch_size=4)
    assert args.deepspeed["scheduler"]["params"]["total_num_steps"] == 500
    assert not [w for w in recwarn if issubclass(w.category, DeepSpeedConfigWarning)]
    with pytest.raises(fz.ConfigError, match=r"total_num_steps=500 in the DeepSpeed config vs TrainingArguments "
                                             r"max_steps \(the Trainer's num_training_steps\)=20"):
        made(base, per_device_train_batch_size=4, max_steps=20)  # known now: compared


def test_no_ddp_launch_advice_for_fz_s_own_one_process_group(tmp_path):
    """fz.init starts a one-process group at world 1; transformers then advises launching for DDP,
    which is not what happened: the arguments on fz do not pass that advice on."""
    import logging

    fz.init(torch.nn.Linear(2, 2), fz.Spec())
    assert torch.distributed.is_initialized()
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    told = logging.getLogger("transformers.training_args")
    told.addHandler(handler)
    try:
        fz.hf.TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])
        transformers.TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])  # transformers' own still says it
    finally:
        told.removeHandler(handler)
    assert len([m for m in said if "parallel_mode != ParallelMode.DISTRIBUTED" in m]) == 1, said


def test_optim_and_schedule_a_deepspeed_section_replaces_are_not_refused(tmp_path):
    """transformers ignores `optim` / `lr_scheduler_type` where the DeepSpeed config has its own
    optimizer / scheduler section; fz refuses one it has not only where it would be used."""
    sections = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
                "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}
    odd = dict(optim="adamw_bnb_8bit", lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": .1})
    args = fz.hf.TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], deepspeed=sections, max_steps=STEPS,
                                   **odd)
    spec = quiet(spec_from_args, args, Tiny(), max_steps=STEPS)
    assert spec.provenance["optimizer"][1] == "config"
    for config in ({"zero_optimization": {"stage": 2}}, None):
        with pytest.raises(fz.ConfigError, match=r"optim='adamw_bnb_8bit': fz has no such optimizer(.|\n)*"
                                                 r"lr_scheduler_type='cosine_with_min_lr'"):
            made = fz.hf.TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], deepspeed=config, **odd)
            spec_from_args(made, Tiny(), max_steps=STEPS)  # without a config: when the Trainer reads the arguments


@pytest.mark.parametrize("arg", [False, True])
def test_a_configs_dataloader_drop_last_is_the_arguments_under_the_trainer(arg, tmp_path, recwarn):
    """transformers' loader reads TrainingArguments.dataloader_drop_last and never the config's key:
    explain() says so, and a config that says otherwise is warned about, not dropped silently."""
    cfg = {"train_micro_batch_size_per_gpu": "auto", "dataloader_drop_last": True, "zero_optimization": {"stage": 2}}
    spec = spec_from_args(make_args(tmp_path, deepspeed=cfg, dataloader_drop_last=arg), Tiny(), max_steps=STEPS)
    outcome, note = spec.provenance.outcomes["dataloader_drop_last"]
    warned = [str(w.message) for w in recwarn if "dataloader_drop_last" in str(w.message)]
    assert (outcome, bool(warned)) == (("mapped", False) if arg else ("ignored", True))
    assert f"TrainingArguments.dataloader_drop_last={arg}" in note
    assert re.search(r"dataloader_drop_last\s+" + outcome, spec.explain())
