"""Spec.from_deepspeed, section by section: each maps to the fz setting DeepSpeed's semantics give.

Optimizers are compared update by update with the torch optimizer (or fz transformation) DeepSpeed's
type means, the scheduler step by step; then the ZeRO, precision, activation checkpointing and
tensorboard sections. Loading whole configs and the errors: test_config.py.
"""
from __future__ import annotations

import pytest
import torch

import fz


def _updates(transform=None, cls=None, steps=3, **kw):
    """The first `steps` updates of an fz transformation, or of a torch optimizer `cls(**kw)`."""
    torch.manual_seed(0)
    p = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    params = {k: torch.nn.Parameter(v.clone()) for k, v in p.items()}
    opt = cls(list(params.values()), **kw) if cls else None
    state, outs = transform.init(p) if transform else None, []
    for _ in range(steps):
        grads = {k: torch.randn_like(v) for k, v in p.items()}
        if transform:
            u, state = transform.update(grads, state, p)
            outs.append({k: v.clone() for k, v in u.items()})
            fz.optim.apply_updates(p, u)
        else:
            before = {k: x.detach().clone() for k, x in params.items()}
            for k, x in params.items():
                x.grad = grads[k]
            opt.step()
            outs.append({k: params[k].detach() - before[k] for k in p})
    return outs


@pytest.mark.parametrize("params, cls, kw", [
    ({"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1}}, torch.optim.AdamW,
     dict(lr=0.01, weight_decay=0.1)),  # DeepSpeed's Adam: adam_w_mode defaults to true
    ({"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1, "adam_w_mode": False}}, torch.optim.Adam,
     dict(lr=0.01, weight_decay=0.1)),
    ({"type": "AdamW", "params": {"lr": 0.01, "betas": [0.8, 0.9], "adam_w_mode": False}}, torch.optim.AdamW,
     dict(lr=0.01, betas=(0.8, 0.9), weight_decay=0.0)),  # AdamW is AdamW; DeepSpeed's default decay is 0
    ({"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}, torch.optim.AdamW, dict(lr=0.01)),  # torch's 0.01
    ({"type": "sgd", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}, torch.optim.SGD,
     dict(lr=0.1, momentum=0.9, nesterov=True)),
    ({"type": "Adafactor", "params": {"lr": 0.01, "eps": [None, 0.001], "weight_decay": 0.1}},
     torch.optim.Adafactor, dict(lr=0.01, weight_decay=0.1, foreach=False)),
])
def test_optimizer_types_follow_deepspeed_semantics(params, cls, kw):
    spec = fz.Spec.from_deepspeed({"optimizer": params})
    for got, want in zip(_updates(spec.optimizer), _updates(cls=cls, **kw)):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7)


def test_lamb_and_lion_map_to_fz_with_deepspeed_defaults():
    lamb = fz.Spec.from_deepspeed({"optimizer": {"type": "Lamb", "params": {"lr": 0.01, "weight_decay": 0.01}}})
    assert lamb.provenance["optimizer"][0] == (
        "fz.optim.lamb(lr=0.01, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.01, max_coeff=10.0, min_coeff=0.01, "
        "eps_inside_sqrt=False, bias_correction=True)")
    for got, want in zip(_updates(lamb.optimizer), _updates(fz.optim.lamb(lr=0.01, weight_decay=0.01))):
        torch.testing.assert_close(got, want)
    lion = fz.Spec.from_deepspeed({"optimizer": {"type": "Lion", "params": {"lr": 1e-4}}})
    for got, want in zip(_updates(lion.optimizer), _updates(fz.optim.lion(lr=1e-4, betas=(0.9, 0.999)))):
        torch.testing.assert_close(got, want)


def test_scheduler_becomes_the_optimizer_lr():
    cfg = {"optimizer": {"type": "SGD", "params": {"lr": 0.5}},
           "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto",
                                                              "warmup_type": "linear"}}}
    spec = fz.Spec.from_deepspeed(cfg, total_steps=20, warmup_steps=5)
    want = fz.optim.WarmupCosineLR(total_num_steps=20, lr=0.5, warmup_num_steps=5, warmup_type="linear")
    assert spec.provenance["scheduler"] == (want, "config")
    opt = spec.optimizer
    p = {"w": torch.zeros(2)}
    state = opt.init(p)
    for k in range(8):
        u, state = opt.update({"w": torch.ones(2)}, state, p)
        assert float(u["w"][0]) == pytest.approx(-want(k)) and fz.optim.current_lr(state) == pytest.approx(want(k))
    spec = fz.Spec.from_deepspeed({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto"}}},
                                  lr=0.2)  # lr= builds the optimizer and fills the absent max lr; min "auto" is 0
    assert spec.provenance["scheduler"][0] == fz.optim.WarmupLR(warmup_min_lr=0.0, warmup_max_lr=0.2)
    spec = fz.Spec.from_deepspeed({"optimizer": {"type": "SGD", "params": {"lr": 0.3}},
                                   "scheduler": {"type": "WarmupLR"}})  # warmup_max_lr: the optimizer's lr
    assert spec.provenance["scheduler"][0] == fz.optim.WarmupLR(warmup_max_lr=0.3)


def test_zero_and_precision_mapping():
    cfg = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 2**20, "allgather_bucket_size": 2**19,
                                 "stage3_param_persistence_threshold": 1e4, "stage3_max_live_parameters": 10 * 2**19},
           "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
                    "hysteresis": 3, "consecutive_hysteresis": True, "min_loss_scale": 0.5},
           "communication_data_type": "bf16", "gradient_clipping": 0.0, "steps_per_print": 5, "seed": 7}
    spec = fz.Spec.from_deepspeed(cfg)
    assert spec.bucket_mb == 2**19 * 4 / 2**20  # the smaller of the two sizes, elements -> MB
    assert (spec.stage, spec.persist_threshold, spec.live_buckets) == (3, 10_000, 10)
    assert spec.loss_scaling == fz.spec.LossScale(loss_scale=0.0, initial_scale_power=12, loss_scale_window=500,
                                                hysteresis=3, consecutive_hysteresis=True, min_loss_scale=0.5,
                                                raise_at_min=True)  # DeepSpeed's ZeRO 1-3 scaler raises at its floor
    assert spec.precision == "fp16"
    assert (spec.reduce_dtype, spec.clip_grad_norm, spec.seed) == ("bf16", None, 7)
    assert fz.Monitor.settings_of(spec)["log_every"] == 5
    assert fz.Spec.from_deepspeed({"zero_optimization": True}).stage == 1  # DeepSpeed's deprecated boolean form
    assert fz.Spec.from_deepspeed({"zero_optimization": {"stage3_max_live_parameters": 0}}).live_buckets >= 2
    if "prefetch" in {f.name for f in fz.Spec.__dataclass_fields__.values()}:
        spec = fz.Spec.from_deepspeed({"zero_optimization": {"reduce_bucket_size": 2**18,
                                                             "stage3_prefetch_bucket_size": 2**19}})
        assert spec.prefetch == 2 and spec.live_buckets >= 2 + spec.prefetch
    assert fz.Spec.from_deepspeed({"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}},
                                  precision="bf16").precision == "bf16"
    assert fz.Spec.from_deepspeed({"bf16": {"enabled": True}, "fp16": {"enabled": "auto"}}).precision == "bf16"
    assert fz.Spec.from_deepspeed({"bfloat16": {"enabled": True}}).precision == "bf16"


def test_activation_checkpointing_and_tensorboard():
    on = fz.Spec.from_deepspeed({"activation_checkpointing": {"partition_activations": True, "profile": False}})
    off = fz.Spec.from_deepspeed({"activation_checkpointing": {"partition_activations": False}})
    assert on.activation_checkpointing is True and off.activation_checkpointing is False
    assert "activation_checkpointing.profile" in on.provenance.ignored
    tb = fz.Spec.from_deepspeed({"tensorboard": {"enabled": True, "output_path": "out/", "job_name": "run1"}})
    assert fz.Monitor.settings_of(tb)["log_dir"] == "out/run1"
    off = fz.Spec.from_deepspeed({"tensorboard": {"enabled": False, "output_path": "out/"}})
    assert fz.Monitor.settings_of(off)["log_dir"] is None
