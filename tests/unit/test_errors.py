"""Bad input gets a ConfigError that names the cause."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fz

from support.helpers import make_model, rank_batches, spec


@pytest.mark.parametrize("kw, words", [
    (dict(stage=5), ["stage", "5", "0, 1, 2, 3"]),
    (dict(grad_accum=0), ["grad_accum", "0", ">= 1"]),
    (dict(precision="fp8"), ["precision", "fp8", "fp32, bf16, fp16"]),
    (dict(clip_grad_norm=-1.0), ["clip_grad_norm"]),
    (dict(live_buckets=1), ["live_buckets"]),
])
def test_bad_spec(kw, words):
    with pytest.raises(fz.ConfigError) as e:
        fz.Spec(**kw)
    for w in words:
        assert w in str(e.value)


def test_batch_not_divisible_by_grad_accum():
    state = fz.init(make_model(), spec(2, 2))
    batch = rank_batches(1, 2, 1)[0][0][:3]  # 3 rows, grad_accum 2
    with pytest.raises(fz.ConfigError, match=r"leading dimension 3 is not divisible by grad_accum=2"):
        fz.train_step(state, batch)
    # nothing was consumed: the state still trains
    state, loss = fz.train_step(state, rank_batches(1, 2, 1)[0][0])
    assert torch.isfinite(loss)


def test_batch_size_inconsistent_with_micro_batch():
    state = fz.init(make_model(), spec(0, 2, micro_batch=3))
    with pytest.raises(fz.ConfigError, match=r"batch has 4 rows but grad_accum=2 x micro_batch=3 = 6 \(batch sizes "
                                             r"are inconsistent with the spec\)$"):
        fz.train_step(state, rank_batches(1, 2, 1)[0][0])
    one_sample = rank_batches(1, 2, 1)[0][0][0]  # a 1-D sample: no rows dimension
    with pytest.raises(fz.ConfigError, match=rf"its tensors are 1-D: one sample of {len(one_sample)} values\? A "
                                             r"batch's first dimension is its rows \(x.unsqueeze\(0\) for one row\)"):
        fz.train_step(state, one_sample)


def test_inconsistent_batch_leading_dims():
    state = fz.init(make_model(), fz.Spec(loss_fn=lambda m, b: m(b["x"]).mean()))
    with pytest.raises(fz.ConfigError, match="same leading"):
        fz.train_step(state, {"x": torch.zeros(4, 8, dtype=torch.long), "y": torch.zeros(3)})


def test_model_without_parameters():
    with pytest.raises(fz.ConfigError, match="no parameters"):
        fz.init(nn.ReLU(), fz.Spec())


def test_all_frozen_model_is_an_inference_state_that_refuses_to_train():
    model = make_model().requires_grad_(False)
    state = fz.init(model, spec(0, 1))  # what TRL's reference model is: evaluated, never trained
    batch = rank_batches(1, 1, 1)[0][0]
    assert torch.isfinite(fz.eval_step(state, batch))
    with pytest.raises(fz.ConfigError, match="every parameter of this state's model is frozen"):
        fz.train_step(state, batch)


def test_loss_fn_returning_non_scalar():
    state = fz.init(make_model(), fz.Spec(loss_fn=lambda m, b: m(b)))  # logits, not a loss
    with pytest.raises(fz.ConfigError, match=r"loss_fn must return a scalar tensor; got \(4, 16, 64\)"):
        fz.train_step(state, torch.zeros(4, 16, dtype=torch.long))
    state = fz.init(make_model(), fz.Spec())  # no loss_fn: the model's output is taken as the loss
    for step in (fz.train_step, fz.eval_step):
        with pytest.raises(fz.ConfigError, match=r"the Spec has no loss_fn, so fz took the model's output as the "
                                                 r"loss, and it is a tensor of shape \(4, 16, 64\), not a scalar"):
            step(state, torch.zeros(4, 16, dtype=torch.long))


@pytest.mark.parametrize("stage", [0, 3])
def test_a_loss_that_never_calls_the_model_it_is_given_is_an_error(stage):
    """Its gradients would reach another module, and the State would train on nothing (TRL's GKD did
    so silently): named before backward, at every stage."""
    other = make_model(1)
    state = fz.init(make_model(), spec(stage, 1, loss_fn=lambda model, batch: other(batch[:, :-1]).float().mean()))
    with pytest.raises(fz.ConfigError, match="reached none of the State.s trainable parameters: .* with the `model`"):
        fz.train_step(state, rank_batches(1, 1, 1)[0][0])


def test_donated_state_refuses_reuse():
    state = fz.init(make_model(), spec(0, 1))
    batch = rank_batches(1, 1, 1)[0][0]
    new, _ = fz.train_step(state, batch)
    with pytest.raises(fz.ConfigError, match=r"fz.train_step: this state was donated to fz.train_step; use the "
                                             r"state it returned \(`state, loss = fz.train_step\(state, batch\)`; "
                                             r"donate=False keeps this one"):
        fz.train_step(state, batch)
    for read, what in ((lambda: state.params, "state.params"), (lambda: state.master, "state.master"),
                       (lambda: fz.optim.current_lr(state), "fz.optim.current_lr")):
        with pytest.raises(fz.ConfigError, match=rf"{what}: this state was donated to fz.train_step"):
            read()  # a TypeError / AttributeError / "no learning rate recorded" before
    with pytest.raises(fz.ConfigError, match=r"the optimizer state is None: a donated state's"):
        fz.optim.current_lr(state.opt_state)
    kept, _ = fz.train_step(new, batch, donate=False)
    fz.train_step(new, batch)  # donate=False left `new` usable
    assert int(kept.step) == 2


def test_meta_module_without_reset_parameters():
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(4, 4))

        def forward(self, x):
            return x @ self.w

    with torch.device("meta"):
        m = Bare()
    with pytest.raises(fz.ConfigError, match="reset_parameters"):
        fz.init(m, fz.Spec())


def _trainer_optimizer(lr: float, weight_decay: float):
    """fz.hf.Trainer's AdamW with its decay masked (no decay for biases and norms)."""
    from fz.hf.optimizers import TrainerOptimizer
    return TrainerOptimizer("adamw_torch", weight_decay=weight_decay, decay=frozenset({"wte.weight"}))(lr)


@pytest.mark.parametrize("make, words", [
    (lambda: fz.optim.adamw(lr=-1.0), r"learning rate -1.0: it must be a finite number >= 0, at most 10000"),
    (lambda: fz.optim.sgd(lr=1e300), r"learning rate 1e\+300: it must be a finite number >= 0, at most 10000 "
                                     r"\(a larger one writes inf into the weights\)"),
    (lambda: fz.optim.adamw(lr=float("nan")), r"learning rate nan"),
    (lambda: fz.optim.adamw(betas=(1.5, 0.999)), r"adam betas\[0\]=1.5: must be in \[0, 1\)"),
    (lambda: fz.optim.adam(eps=-1.0), r"adam eps=-1.0: must be > 0"),
    # torch takes these three: eps=0 put 0/0 = NaN into every weight the batch gave no gradient (an embedding
    # row), 1e308 made every weight inf at the first update
    (lambda: fz.optim.adamw(eps=0.0), r"adam eps=0.0: must be > 0: .* 0 / 0 = NaN"),
    (lambda: fz.optim.adamw(weight_decay=1e308), r"weight_decay=1e\+308: must be a number from 0 to 1000"),
    (lambda: fz.optim.sgd(momentum=1e308), r"momentum=1e\+308: must be a number from 0 to 1 \(a larger one grows"),
    (lambda: fz.optim.lamb(eps=0.0), r"lamb eps=0.0: must be > 0"),
    (lambda: fz.optim.adafactor(eps=(0.0, 1e-3)), r"adafactor eps=\(0.0, 0.001\): eps1 must be > 0 or None"),
    (lambda: fz.optim.adamw(weight_decay=float("inf")), r"weight_decay=inf: must be a number from 0 to 1000"),
    (lambda: fz.optim.sgd(momentum=-0.5), r"momentum=-0.5: must be a number from 0 to 1"),
    (lambda: fz.optim.adamw(lr=lambda step: 1e-3 * 100**step, weight_decay=100.0),
     r"learning rate 0.1 x weight_decay 100.0 = 10 at update 1: must be at most 1 .*flips their sign"),
    # each way decay meets the lr: the chain's AdamW (DeepSpeed's bias_correction=false), Lion, SGD's L2
    (lambda: fz.optim.adamw(lr=0.1, weight_decay=100.0, bias_correction=False), r"= 10 at update 0: must be at most"),
    (lambda: fz.optim.lion(lr=0.1, weight_decay=100.0), r"= 10 at update 0: must be at most 1"),
    (lambda: fz.optim.sgd(lr=0.1, momentum=0.9, weight_decay=100.0), r"= 10 at update 0: must be at most 1"),
    (lambda: _trainer_optimizer(0.1, 100.0), r"= 10 at update 0: must be at most 1"),
    (lambda: fz.optim.adamw(lr=lambda step: float("nan") if step else 1e-3), r"the schedule's, at update 1"),
])
def test_optimizer_hyperparameters_torch_refuses_are_refused(make, words):
    """lr=nan turned every weight to NaN at the first step, then skipped each one after; a beta of 1.5
    or a negative eps trained on. torch.optim and the DeepSpeed config path refuse them."""
    with pytest.raises(fz.ConfigError, match=words):
        state = fz.init(make_model(), spec(0, 1, optimizer=make()))
        for batch in rank_batches(1, 1, 2):
            state, _ = fz.train_step(state, batch[0])


@pytest.mark.parametrize("section, words", [
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e300}}}, r"optimizer.params.lr: 1e\+300 must be <= 10000"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 1e39}}}, r"optimizer.params.lr: 1e\+39 must be <= 10000"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e300}}},
     r"scheduler.params.warmup_max_lr: 1e\+300 must be <= 10000"),
    ({"optimizer": {"type": "AdamW", "params": {"eps": 0}}}, r"optimizer.params.eps: 0 must be > 0.0 \(0 divides 0"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decay": 1e308}}},
     r"optimizer.params.weight_decay: 1e\+308 must be <= 1000.0 \(no optimizer trains with more"),
    ({"optimizer": {"type": "SGD", "params": {"momentum": 1e308}}}, r"optimizer.params.momentum: 1e\+308 must be <= 1"),
    ({"fp16": {"enabled": True, "initial_scale_power": 1000}}, r"fp16.initial_scale_power: 1000 must be <= 64"),
    ({"fp16": {"enabled": True, "loss_scale": 1e300}}, r"fp16.loss_scale: 1e\+300 must be <= 1.8"),
])
def test_a_config_value_that_would_write_inf_is_refused_naming_the_key(section, words):
    """Finite in JSON, inf in fp32: an lr of 1e300 made every weight inf at the first step (the
    gradients are checked, not the update); a loss scale past 2**64 (2**1000: inf) skipped every step."""
    with pytest.raises(fz.ConfigError, match=words):
        fz.Spec.from_deepspeed({"train_micro_batch_size_per_gpu": 2, **section})


def test_the_dynamic_loss_scale_never_grows_to_inf():
    """Clean steps double it every window; fp32 holds it, so it stops at 2**64 (every fp16 gradient
    overflows long before): never inf, which would skip every later step."""
    from fz.precision import MAX_LOSS_SCALE, LossScale
    from fz.step.scaler import init_scaler, update_scaler
    spec = fz.Spec(precision="fp16", loss_scaling=LossScale(initial_scale_power=63, loss_scale_window=1))
    scaler = init_scaler(spec)
    for _ in range(5):
        scaler = update_scaler(spec, scaler, overflow=False)
    assert float(scaler["scale"]) == MAX_LOSS_SCALE
