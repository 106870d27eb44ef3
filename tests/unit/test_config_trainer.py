"""DeepSpeed configs as people write them (issue 14): the keywords a Hugging Face Trainer fills
in, keywords that contradict the config, unknown keys, loud warnings, bias_correction.

Pure Python: every test builds Specs (and, for optimizer semantics, runs a few updates on
two small tensors); nothing spawns.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import fz
from fz.config import DeepSpeedConfigWarning

from support.helpers import transform_updates as updates

HF_AUTO = {  # the "auto" style of the transformers / accelerate templates
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "gradient_clipping": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
}


def load(cfg, **kw):
    """from_deepspeed, with no warning allowed."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeepSpeedConfigWarning)
        return fz.Spec.from_deepspeed(cfg, **kw)


def torch_updates(make_opt, steps=3, schedule=None):
    """The same updates from a torch optimizer (and an optional LambdaLR, stepped after each step)."""
    torch.manual_seed(0)
    p = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    params = {k: torch.nn.Parameter(v.clone()) for k, v in p.items()}
    opt = make_opt(list(params.values()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if schedule else None
    out = []
    for _ in range(steps):
        before = {k: x.detach().clone() for k, x in params.items()}
        for k, x in params.items():
            x.grad = torch.randn_like(p[k])
        opt.step()
        if sched:
            sched.step()
        out.append({k: params[k].detach() - before[k] for k in p})
    return out


def assert_same_updates(got, want):
    for g, w in zip(got, want, strict=True):
        for k in w:
            torch.testing.assert_close(g[k], w[k], rtol=1e-5, atol=3e-7)  # want: differences of params ~1


# --- the Trainer's defaults are valid values ---------------------------------------------------------------

def test_warmup_zero_and_clip_zero_are_accepted_as_the_trainer_passes_them():
    spec = load(HF_AUTO, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, micro_batch=2, grad_accum=1,
                clip_grad_norm=0.0, warmup_steps=0)
    assert spec.provenance["scheduler"][0] == fz.optim.WarmupLR(warmup_max_lr=1e-3, warmup_num_steps=0)
    assert spec.clip_grad_norm is None  # max_grad_norm=0 means off
    schedule = load({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0, "warmup_max_lr": 0.1}}})
    lr = schedule.provenance["scheduler"][0]
    assert [lr(k) for k in range(4)] == [0.0, 0.0, 0.1, 0.1]  # DeepSpeed: max(2, warmup_num_steps)
    assert load({}, clip_grad_norm=None).clip_grad_norm is None
    assert load({}, clip_grad_norm=0.5).clip_grad_norm == 0.5  # an absent key takes the keyword


# --- precision= without the matching section --------------------------------------------------------------

@pytest.mark.parametrize("cfg, precision", [
    ({"fp16": {"enabled": "auto"}}, "bf16"),
    ({"bf16": {"enabled": "auto"}}, "fp16"),
    ({}, "bf16"),
    ({"fp16": {"enabled": False}}, "bf16"),
    ({"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}, "fp32"),
])
def test_precision_keyword_adds_the_missing_section(cfg, precision):
    spec = load(cfg, precision=precision)
    assert spec.precision == precision and "precision" not in spec.provenance.unused_auto


@pytest.mark.parametrize("cfg, precision, match", [
    ({"fp16": {"enabled": True}}, "bf16", r"fp16\.enabled: the config says true but the keyword precision='bf16'"),
    ({"bf16": {"enabled": False}}, "bf16", r"bf16\.enabled: the config says false but the keyword precision='bf16'"),
    ({"bf16": {"enabled": True}}, "fp32", r"bf16\.enabled: .* precision='fp32'"),
])
def test_precision_keyword_contradicting_the_config_raises(cfg, precision, match):
    with pytest.raises(fz.ConfigError, match=match):
        fz.Spec.from_deepspeed(cfg, precision=precision)


# --- stage-3 sizes as the Trainer writes them -------------------------------------------------------------

def test_trainer_bucket_sizes_prefetch_at_least_one_block():
    h = 64
    written = load({"zero_optimization": {"stage": 3, "reduce_bucket_size": h * h,
                                          "stage3_prefetch_bucket_size": int(0.9 * h * h),
                                          "stage3_param_persistence_threshold": 10 * h}})
    assert written.prefetch == 1 and written.live_buckets >= 3
    auto = load({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                       "stage3_param_persistence_threshold": "auto"}}, hidden_size=h)
    assert (auto.bucket_mb, auto.prefetch, auto.persist_threshold) == (h * h * 4 / 2**20, 1, 10 * h)
    assert (written.bucket_mb, written.prefetch, written.persist_threshold) == (auto.bucket_mb, 1, 10 * h)
    assert load({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0}}).prefetch == 0
    assert load({"zero_optimization": {"reduce_bucket_size": 100, "stage3_prefetch_bucket_size": 250}}).prefetch == 3
    stage2 = load({"zero_optimization": {"stage": 2, "stage3_param_persistence_threshold": "auto"}}, hidden_size=h)
    assert stage2.persist_threshold == fz.Spec().persist_threshold  # the Trainer fills it at stage 3 only


# --- no optimizer / scheduler section: the Trainer's AdamW and linear schedule --------------------------

def _hf_linear(warmup, total):  # transformers.get_linear_schedule_with_warmup's lr_lambda
    def f(k):
        if k < warmup:
            return k / max(1, warmup)
        return max(0.0, (total - k) / max(1, total - warmup))
    return f


def test_keywords_build_the_trainer_optimizer_and_schedule():
    kw = dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, warmup_steps=2, total_steps=5)
    spec = load({"train_micro_batch_size_per_gpu": 2}, **kw)
    assert spec.provenance.unused_auto == []
    assert spec.provenance["scheduler"] == (fz.optim.warmup_linear(0.01, 2, 5), "auto")
    want = torch_updates(lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
                         steps=5, schedule=_hf_linear(2, 5))
    assert_same_updates(updates(spec.optimizer, steps=5), want)
    plain = load({}, lr=2e-5)  # lr alone: constant, torch AdamW's other defaults
    assert_same_updates(updates(plain.optimizer), torch_updates(lambda p: torch.optim.AdamW(p, lr=2e-5)))
    # an optimizer section without a scheduler: the Trainer's schedule on DeepSpeed's optimizer
    sgd = load({"optimizer": {"type": "SGD", "params": {"lr": 0.5}}}, total_steps=4)
    assert_same_updates(updates(sgd.optimizer, steps=4),
                        torch_updates(lambda p: torch.optim.SGD(p, lr=0.5), steps=4, schedule=_hf_linear(0, 4)))
    assert load({}).provenance["optimizer"][1] == "default"  # no keywords: fz's default AdamW, as before


# --- a keyword that contradicts an explicit value -----------------------------------------------------------

@pytest.mark.parametrize("cfg, kw, match", [
    ({"gradient_accumulation_steps": 1}, dict(grad_accum=8),
     r"^gradient_accumulation_steps: the config says 1 but the keyword grad_accum=8; they contradict"),
    ({"train_micro_batch_size_per_gpu": 4}, dict(micro_batch=2), r"train_micro_batch_size_per_gpu: .* micro_batch=2"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, dict(lr=2e-5),
     r"optimizer\.params\.lr: the config says 0\.001 but the keyword lr=2e-05"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.95]}}}, dict(betas=(0.9, 0.999)),
     r"optimizer\.params\.betas: the config says \(0\.9, 0\.95\) but the keyword betas=\(0\.9, 0\.999\)"),
    ({"gradient_clipping": 1.0}, dict(clip_grad_norm=0.5), r"gradient_clipping: the config says 1\.0 .*=0\.5"),
    ({"gradient_clipping": 1.0}, dict(clip_grad_norm=0.0), r"gradient_clipping: .*clip_grad_norm=0\.0"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}}}, dict(total_steps=50),
     r"scheduler\.params\.total_num_steps: the config says 100 but the keyword total_steps=50"),
    ({"train_batch_size": 32}, dict(micro_batch=4, grad_accum=2, world_size=2),
     r"train_batch_size=32 != train_micro_batch_size_per_gpu=4 \(micro_batch=\) \* "
     r"gradient_accumulation_steps=2 \(grad_accum=\) \* world_size=2"),
])
def test_keyword_contradicting_the_config_raises_naming_both(cfg, kw, match):
    with pytest.raises(fz.ConfigError, match=match):
        fz.Spec.from_deepspeed(cfg, **kw)


def test_keywords_that_agree_or_fill_absent_keys_are_used():
    spec = load({"gradient_accumulation_steps": 8, "train_batch_size": 64, "gradient_clipping": 0},
                grad_accum=8, micro_batch=4, clip_grad_norm=None, world_size=2)
    assert (spec.grad_accum, spec.micro_batch, spec.clip_grad_norm) == (8, 4, None)
    assert spec.provenance.unused_auto == []
    spec = load({"train_batch_size": 32}, micro_batch=4, world_size=2)  # the keyword fills the absent micro size
    assert (spec.micro_batch, spec.grad_accum) == (4, 4)


# --- unknown keys -------------------------------------------------------------------------------------------

REAL_EXTRAS = {"_comment": "ZeRO-3 for 7B", "comms_config": {"verbose": False}, "monitor_config": {"enabled": False},
               "cuda_visible_devices": "0,1", "train_micro_batch_size_per_gpu": 2}


def test_unknown_top_level_keys_are_accepted_listed_and_warned():
    with pytest.warns(DeepSpeedConfigWarning) as record:
        spec = fz.Spec.from_deepspeed(REAL_EXTRAS)
    assert len(record) == 1
    text = str(record[0].message)
    assert "keys neither DeepSpeed nor fz knows, ignored: comms_config, monitor_config, cuda_visible_devices" in text
    assert "_comment" not in text
    rows = {ln.split()[0]: ln.split(None, 2)[1:] for ln in spec.explain().splitlines() if ln.startswith("  ")}
    assert rows["_comment"] == ["ignored", "a comment"] and rows["comms_config"][0] == "ignored"
    assert load({"_comment": "x", "_note": {"a": 1}}, strict=True).micro_batch is None  # comments are fine
    with pytest.raises(fz.ConfigError, match=r"comms_config: unknown DeepSpeed key \(strict=True\)"):
        fz.Spec.from_deepspeed(REAL_EXTRAS, strict=True)


@pytest.mark.parametrize("key, known", [("train_micro_batch_size", "train_micro_batch_size_per_gpu"),
                                        ("gradient_clip", "gradient_clipping"), ("zero_optimisation",
                                                                                 "zero_optimization"),
                                        ("tensorboard_dir", "tensorboard"), ("bf_16", "bf16")])
def test_near_misses_of_known_keys_are_typos(key, known):
    with pytest.raises(fz.ConfigError, match=rf"^{key}: unknown DeepSpeed key \(did you mean '{known}'\?"):
        fz.Spec.from_deepspeed({key: 1})


FASTCHAT_S3 = {  # FastChat's playground/deepspeed_config_s3.json as the issue quotes it: one misspelt "auto" key
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
    "micro_batch_size_per_gpu": "auto",  # DeepSpeed and the Trainer ignore it
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "train_batch_size": "auto",
}


def test_a_misspelt_key_set_to_auto_warns_naming_the_likely_key():
    kw = dict(micro_batch=4, grad_accum=2, clip_grad_norm=1.0, precision="bf16", world_size=1)
    with pytest.warns(DeepSpeedConfigWarning, match=r"micro_batch_size_per_gpu: unknown DeepSpeed key \(did you "
                      r"mean 'train_micro_batch_size_per_gpu'\?\) set to \"auto\": ignored") as record:
        spec = fz.Spec.from_deepspeed(FASTCHAT_S3, **kw)
    assert len(record) == 1
    assert (spec.stage, spec.micro_batch, spec.grad_accum, spec.precision) == (3, 4, 2, "bf16")
    row = next(ln for ln in spec.explain().splitlines() if ln.strip().startswith("micro_batch_size_per_gpu"))
    assert row.split()[1] == "ignored" and "train_micro_batch_size_per_gpu" in row
    with pytest.raises(fz.ConfigError, match=r"^micro_batch_size_per_gpu: unknown DeepSpeed key \(did you mean "
                       r"'train_micro_batch_size_per_gpu'\?\)$"):  # a stated value would change training
        fz.Spec.from_deepspeed({**FASTCHAT_S3, "micro_batch_size_per_gpu": 4}, **kw)
    with pytest.raises(fz.ConfigError, match=r"micro_batch_size_per_gpu: unknown DeepSpeed key"):
        fz.Spec.from_deepspeed(FASTCHAT_S3, strict=True, **kw)


def test_optimizer_and_schedule_keywords_replace_the_trainer_defaults():
    spec = load({}, lr=0.1, optimizer=lambda lr: fz.optim.sgd(lr=lr), schedule=lambda lr: fz.optim.constant(lr / 2),
                warmup_steps=3, total_steps=9)
    assert spec.provenance.unused_auto == []
    assert spec.provenance["scheduler"] == (fz.optim.constant(0.05), "auto")
    assert_same_updates(updates(spec.optimizer), torch_updates(lambda p: torch.optim.SGD(p, lr=0.05)))
    section = load({"optimizer": {"type": "SGD", "params": {"lr": 0.5}}}, optimizer=lambda lr: fz.optim.adamw(lr))
    assert section.provenance["optimizer"][0].startswith("fz.optim.sgd")  # a section wins, as in the Trainer
    with pytest.raises(fz.ConfigError, match=r"^optimizer: must be a callable taking the optimizer's lr"):
        fz.Spec.from_deepspeed({}, optimizer="adamw")


# --- features that change training but fz lacks: one loud warning at load -----------------------------------

FEATURES = {
    "curriculum_learning": {"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen",
                                                    "min_difficulty": 8, "max_difficulty": 1024}},
    "data_efficiency": {"data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
        "enabled": True}}}},  # random-LTD
    "progressive_layer_drop": {"progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.001}},
    "sparse_attention": {"sparse_attention": {"mode": "fixed", "block": 16}},
    "tensor_parallel": {"tensor_parallel": {"autotp_size": 2}},
    "fp16.auto_cast": {"fp16": {"enabled": True, "auto_cast": True}},
    "scheduler.params.cycle_momentum": {"scheduler": {"type": "OneCycle", "params": {
        "cycle_min_lr": 0.001, "cycle_max_lr": 0.01}}},  # on by default in DeepSpeed
}


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_unsupported_features_warn_once_at_load_and_strict_refuses(name):
    with pytest.warns(DeepSpeedConfigWarning, match=rf"fz does not implement {name}\b.*IGNORED") as record:
        spec = fz.Spec.from_deepspeed(FEATURES[name])
    assert len(record) == 1 and name in spec.provenance.unsupported
    with pytest.raises(fz.ConfigError, match=rf"\(strict=True\): fz does not implement {name}\b"):
        fz.Spec.from_deepspeed(FEATURES[name], strict=True)


def test_all_unsupported_features_in_one_warning():
    cfg = {k: v for d in FEATURES.values() for k, v in d.items() if k not in ("zero_optimization", "scheduler")}
    with pytest.warns(DeepSpeedConfigWarning) as record:
        fz.Spec.from_deepspeed(cfg)
    assert len(record) == 1
    assert all(name in str(record[0].message) for name in FEATURES if "cycle" not in name)
    load({"fp16": {"enabled": False, "auto_cast": True},  # options of a section that is off: no warning
          "zero_optimization": {"offload_optimizer": {"device": "none"}, "offload_param": False}})


# --- optimizer options --------------------------------------------------------------------------------------

def _adam_no_bias_correction(lr, b1=0.9, b2=0.999, eps=1e-8):
    """DeepSpeed FusedAdam with bias_correction=False: lr * m / (sqrt(v) + eps), no 1 - beta**t."""
    def make(params):
        state = {id(p): (torch.zeros_like(p), torch.zeros_like(p)) for p in params}

        class Opt:
            @staticmethod
            def step():
                with torch.no_grad():
                    for p in params:
                        m, v = state[id(p)]
                        m.mul_(b1).add_(p.grad, alpha=1 - b1)
                        v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                        p.sub_(lr * m / (v.sqrt() + eps))
        return Opt()
    return make


@pytest.mark.parametrize("kind, extra", [("Adam", {}), ("AdamW", {}), ("Adam", {"adam_w_mode": False})])
def test_bias_correction_false_is_fused_adams(kind, extra):
    spec = load({"optimizer": {"type": kind, "params": {"lr": 0.01, "bias_correction": False, **extra}}})
    assert_same_updates(updates(spec.optimizer), torch_updates(_adam_no_bias_correction(0.01)))
    assert "bias_correction=False" in spec.provenance["optimizer"][0]


@pytest.mark.parametrize("kind", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_compressed_optimizers_are_a_clear_error(kind):
    with pytest.raises(fz.ConfigError, match=rf"optimizer\.type: '{kind}' compresses gradient communication"):
        fz.Spec.from_deepspeed({"optimizer": {"type": kind, "params": {"lr": 1e-3}}})


# --- explain and DeepSpeed's own warnings -----------------------------------------------------------------

def test_explain_names_the_bfloat16_key_it_read():
    spec = load({"bfloat16": {"enabled": True}})
    row = next(ln for ln in spec.explain().splitlines() if ln.startswith("precision "))
    assert row.split()[1:3] == ["config", "bfloat16.enabled"] and "bf16.enabled" not in spec.explain()


@pytest.mark.parametrize("kind", ["WarmupDecayLR", "WarmupCosineLR"])
def test_fewer_total_steps_than_warmup_steps_warns(kind):
    cfg = {"scheduler": {"type": kind, "params": {"total_num_steps": 5, "warmup_num_steps": 10}}}
    with pytest.warns(DeepSpeedConfigWarning, match="total_num_steps=5 is less than warmup_num_steps=10"):
        fz.Spec.from_deepspeed(cfg)
    with pytest.warns(DeepSpeedConfigWarning, match="the Trainer's linear schedule: total_num_steps=5"):
        fz.Spec.from_deepspeed({}, total_steps=5, warmup_steps=10)
    load({"scheduler": {"type": kind, "params": {"total_num_steps": 10, "warmup_num_steps": 10}}})  # no warning
