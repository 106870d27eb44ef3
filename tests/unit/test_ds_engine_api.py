"""fz.deepspeed at world 1: a client's torch optimizer and scheduler train as torch trains with them,
and DeepSpeed's calls that fz cannot honour fail naming why."""
from __future__ import annotations

import argparse
import math

import pytest
import torch
from torch import nn

import fz
import fz.deepspeed as deepspeed
from fz.optim.from_torch import TorchSchedule

# gradient_clipping 0: no clip, as the torch loops these runs are checked against (DeepSpeed clips at 1.0 by default)
CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0}
ADAM = {**CONFIG, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}  # an engine that trains needs one


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 3)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.out(self.norm(torch.tanh(self.lin(self.frozen(x))))), y)


def _batches(n=6):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def _groups(model):
    decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and not any(p is d for d in decay)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_client_optimizer_groups_and_scheduler_train_as_torch_does(kind):
    def make(model):
        opt = (torch.optim.AdamW(_groups(model), lr=0.05, betas=(0.8, 0.99), eps=1e-7) if kind == "adamw"
               else torch.optim.SGD(_groups(model), lr=0.05, momentum=0.9, nesterov=True))
        return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10, cycle_momentum=False)

    ref = Net()
    opt, sched = make(ref)
    ref_losses, ref_lrs = [], []
    for x, y in _batches():
        loss = ref(x, y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
        ref_lrs.append(sched.get_last_lr()[0])

    model = Net()
    opt, sched = make(model)
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                                              config={**CONFIG, "zero_optimization": {"stage": 2}})
    losses, lrs = [], []
    for x, y in _batches():
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        lrs.append(lr_scheduler.get_last_lr()[0])
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert lrs == pytest.approx(ref_lrs, rel=1e-12)  # the next update's lr, as torch's scheduler says
    assert optimizer.param_groups[0]["lr"] == pytest.approx(ref_lrs[-1], rel=1e-12)
    assert len(engine.get_lr()) == 2  # one per group, as DeepSpeed's optimizer holds them
    got = dict(engine.module.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", [
    lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=7),
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=20),
    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1 / (k + 1)),
])
def test_a_torch_scheduler_becomes_its_own_lrs(make):
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=0.1)
    sched = make(opt)
    got = [TorchSchedule(sched)(k) for k in range(20)]
    assert sched.last_epoch == 0  # a copy was stepped, not the client's own
    want = []
    for _ in range(20):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert got == want


def test_add_config_arguments_and_the_config_from_args(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}}')
    args = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(
        ["--deepspeed", "--deepspeed_config", str(path)])
    assert args.deepspeed and args.deepspeed_config == str(path)
    engine, _, loader, sched = deepspeed.initialize(args=args, model=Net(), model_parameters=Net().parameters())
    assert engine.zero_optimization_stage() == 1 and loader is None and sched is None
    assert engine.train_batch_size() == 4 and engine.gradient_accumulation_steps() == 1
    with pytest.raises(fz.ConfigError, match="in both args.deepspeed_config and config="):
        deepspeed.initialize(args=args, model=Net(), config=CONFIG)


@pytest.mark.parametrize("kwargs, match", [
    ({}, "needs a DeepSpeed config"),
    ({"config": CONFIG, "mpu": object()}, "model .tensor/pipeline. parallelism is not supported"),
    ({"config": CONFIG, "optimizer": "rmsprop"}, "not str"),
])
def test_initialize_refuses_what_it_cannot_honour(kwargs, match):
    with pytest.raises(fz.ConfigError, match=match):
        deepspeed.initialize(model=Net(), **kwargs)
    net = Net()  # groups of their own lr given as model_parameters: named so (it named an optimizer= never given)
    groups = [{"params": [p], "lr": 1e-2} if i == 0 else {"params": [p]} for i, p in enumerate(net.parameters())]
    with pytest.raises(fz.ConfigError, match=r"^deepspeed.initialize\(model_parameters=groups\): its parameter groups "
                                             r"have different lr \(0.01 and 0.001\)"):
        deepspeed.initialize(model=net, model_parameters=groups, config=ADAM)


def test_client_optimizer_settings_fz_cannot_honour_are_errors():
    model = Net()
    groups = _groups(model)
    groups[1]["lr"] = 0.5
    with pytest.raises(fz.ConfigError, match="different lr"):
        deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=0.1), config=CONFIG)
    with pytest.raises(fz.ConfigError, match="amsgrad=True is not supported"):
        deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), amsgrad=True),
                             config=CONFIG)
    with pytest.raises(fz.ConfigError, match="RMSprop"):
        deepspeed.initialize(model=model, optimizer=torch.optim.RMSprop(model.parameters()), config=CONFIG)
    some = [p for n, p in model.named_parameters() if n.startswith("lin")]
    with pytest.raises(fz.ConfigError, match="trainable parameters are in no group"):
        deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(some), config=CONFIG)


def test_a_config_optimizer_beside_a_client_one_is_reported_not_dropped_silently():
    model = Net()
    cfg = {**CONFIG, "optimizer": {"type": "Adam", "params": {"lr": 0.3}}}
    with pytest.warns(UserWarning, match="'optimizer' section is not used: initialize was given optimizer="):
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                                          config=cfg)
    assert engine.get_lr() == [0.01]


def test_engine_misuse_fails_naming_the_fix():
    engine, *_ = deepspeed.initialize(model=Net(), config={**ADAM, "gradient_accumulation_steps": 2})
    x, y = _batches(1)[0]
    with pytest.raises(fz.ConfigError, match="needs a forward in train mode first"):
        engine.backward(torch.tensor(1.0))
    engine.step()  # not a boundary: only the micro-step count moves, as in DeepSpeed
    assert engine.micro_steps == 1 and engine.global_steps == 0
    with pytest.raises(fz.ConfigError, match="without a backward"):
        engine.step()
    loss = engine(x, y)
    with pytest.raises(fz.ConfigError, match="retain_graph=True"):
        engine.backward(loss, retain_graph=True)


def test_eval_mode_forward_is_fz_apply_and_module_attributes_read_through():
    model = Net()
    model.custom_tag = "kept"
    engine, *_ = deepspeed.initialize(model=model, config=ADAM)
    x, y = _batches(1)[0]
    engine.backward(engine(x, y))
    engine.step()
    engine.eval()
    assert not engine.module.training
    with torch.no_grad():
        out = engine(x, y)
    assert torch.equal(out, fz.apply(engine.state, x, y))
    assert engine.custom_tag == "kept"
    assert torch.equal(engine.out.weight, fz.full_params(engine.state)["out.weight"])
    # a name neither has is the engine's missing attribute, not "'Net' object has no attribute"
    with pytest.raises(AttributeError, match=r"^fz.deepspeed's engine has no attribute 'no_such' \(one of DeepSpeed's "
                                             r"engine fz does not provide, .*nor has its model \(Net\)$"):
        engine.no_such  # noqa: B018


def test_the_engines_getters_answer_as_deepspeeds():
    """DeepSpeed 0.19.8's answers for these configs (steps_per_print None when unset, reduce bucket 5e8, ...),
    which fz's engine reported as the model's missing attributes (get_batch_info: the values, where
    DeepSpeed's returns its three methods)."""
    engine, *_ = deepspeed.initialize(model=Net(), config={**ADAM, "gradient_accumulation_steps": 2})
    micro = engine.train_micro_batch_size_per_gpu()
    assert engine.get_batch_info() == (micro * 2, micro, 2) and engine.steps_per_print() is None
    assert deepspeed.initialize(model=Net(), config={**ADAM, "steps_per_print": 7})[0].steps_per_print() == 7
    assert engine.zero_reduce_bucket_size() == 500_000_000 and engine.wall_clock_breakdown() is False
    assert engine.mp_world_size == 1 and engine.data_parallel_group is not None


def test_load_checkpoint_continues_a_run_deepspeed_started():
    """A run in progress under DeepSpeed (its ZeRO-3 checkpoint, written at world 2) continues in the
    engine at world 1, stage 2: the client state, step and the next two losses are DeepSpeed's."""
    import json

    from support import ds_models as m
    from support.ds_import_jobs import DATA, ROWS
    src = DATA / "stage3_fp32"
    record = json.loads((src / "record.json").read_text())
    cfg = {**m.ds_config(2, "fp32"), "train_micro_batch_size_per_gpu": ROWS, "train_batch_size": ROWS}
    engine, *_ = deepspeed.initialize(model=m.TinyLM(seed=5), config=cfg)
    path, client_state = engine.load_checkpoint(str(src / "ckpt"))
    assert path.endswith("global_step3") and {k: client_state[k] for k in ("step", "note")} == {"step": 3, "note": "x"}
    assert engine.global_steps == 3
    losses = []
    for i in (3, 4):
        tokens = torch.cat([m.batch(i, r) for r in range(m.WORLD)])
        loss = m.lm_loss(engine(tokens), tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    want = [sum(r[i] for r in record["next_losses"]) / m.WORLD for i in range(2)]
    assert losses == pytest.approx(want, rel=1e-6)


def test_load_checkpoint_follows_latest_only_inside_the_load_dir(tmp_path):
    """DeepSpeed's load_checkpoint loads whatever `latest` names (an absolute path, ../other);
    the engine only a tag folder of load_dir, and tag=... where it is told."""
    import shutil

    from support import ds_models as m
    from support.ds_import_jobs import DATA, ROWS
    shutil.copytree(DATA / "stage3_fp32" / "ckpt", tmp_path / "other")
    mine = tmp_path / "mine"
    mine.mkdir()
    cfg = {**m.ds_config(2, "fp32"), "train_micro_batch_size_per_gpu": ROWS, "train_batch_size": ROWS}
    engine, *_ = deepspeed.initialize(model=m.TinyLM(seed=5), config=cfg)
    for tag in ("../other/global_step3", str(tmp_path / "other" / "global_step3")):
        (mine / "latest").write_text(tag)
        with pytest.raises(fz.CheckpointError, match=f"latest names '{tag}', which is not a tag folder inside {mine}"):
            engine.load_checkpoint(str(mine))
        assert engine.global_steps == 0
    path, client_state = engine.load_checkpoint(str(mine), tag="../other/global_step3")
    assert path.endswith("global_step3") and engine.global_steps == 3
    assert {k: client_state[k] for k in ("step", "note")} == {"step": 3, "note": "x"}


def test_fp16_zero0_engine_is_train_steps_step_with_its_loss_scale():
    """Seed 001: ZeRO-0 with fp16 loss scaling. The engine's updates (scaled backward, overflow
    skips, the scale's growth) are fz.train_step's, bit for bit."""
    cfg = {**CONFIG, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 0},
           "fp16": {"enabled": True, "initial_scale_power": 30, "loss_scale_window": 2},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=Net(), config=cfg)
    spec = fz.Spec.from_deepspeed(cfg).replace(loss_fn=lambda model, b: model(*b))
    state = fz.init(Net(), spec)
    batches = _batches(6)
    for i in range(0, 6, 2):
        for x, y in batches[i:i + 2]:
            engine.backward(engine(x, y))
            engine.step()
        state, _ = fz.train_step(state, (torch.cat([batches[i][0], batches[i + 1][0]]),
                                          torch.cat([batches[i][1], batches[i + 1][1]])))
        assert engine.cur_scale == engine.optimizer.cur_scale == float(state.scaler["scale"])
        assert engine.skipped_steps == int(state.scaler["skipped"])
        # DeepSpeed's reads (checked side by side with DeepSpeed 0.19.8): loss_scale() is the config's
        # static scale (0: dynamic), optimizer.overflow the last update's skip, whose norm is inf
        overflow = not engine.was_step_applied()
        assert engine.optimizer.overflow is overflow and (engine.get_global_grad_norm() == math.inf) is overflow
        assert engine.loss_scale() == 0.0 and engine.dynamic_loss_scale()
    assert engine.skipped_steps >= 1 and engine.fp16_enabled()  # 2**30 overflows fp16 at first
    for name, w in fz.full_params(state).items():
        assert torch.equal(fz.full_params(engine.state)[name], w), name


def _sgd(stage: int) -> dict:
    return {**CONFIG, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True}


def _train(engine, batches) -> list[float]:
    losses = []
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_the_scripts_own_model_gives_the_trained_weights_as_deepspeeds_does():
    """DeepSpeed trains the module it is given in place: `model.eval(); model(x)` and
    `model.state_dict()` after training are the trained model's, without reading engine.module."""
    model = Net()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_sgd(0))
    _train(engine, _batches(3))
    trained = {k: v.clone() for k, v in fz.full_params(engine.state).items()}
    saved = model.state_dict()
    assert all(torch.equal(saved[k], v) for k, v in trained.items())
    x, y = _batches(1)[0]
    model.eval()
    with torch.no_grad():
        assert model(x, y).item() == pytest.approx(fz.apply(engine.state, x, y).item(), rel=1e-6)


def test_weights_loaded_into_the_module_after_initialize_are_trained_from():
    """`engine.module.load_state_dict(sd)` after initialize, as DeepSpeed scripts resume weights: the
    next steps train from them, as an engine made on a model holding them does; at stage 3 refused."""
    donor = Net()
    with torch.no_grad():
        for p in donor.parameters():
            p.mul_(1.5)
    model = Net()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_sgd(0))
    engine.module.load_state_dict(donor.state_dict())
    fresh, *_ = deepspeed.initialize(model=donor, model_parameters=donor.parameters(), config=_sgd(0))
    assert _train(engine, _batches(3)) == pytest.approx(_train(fresh, _batches(3)), rel=1e-6)
    model3 = Net()
    engine3, *_ = deepspeed.initialize(model=model3, model_parameters=model3.parameters(), config=_sgd(3))
    with pytest.raises(fz.ConfigError, match="load_state_dict into the engine's model at ZeRO stage 3"):
        model3.load_state_dict(Net().state_dict())


def test_without_an_optimizer_the_engine_is_for_inference_as_deepspeeds():
    """No optimizer= and no section: DeepSpeed's initialize returns optimizer None and its backward
    asserts; fz's engine keeps no optimizer state (a stateless update) and refuses backward."""
    engine, optimizer, _, _ = deepspeed.initialize(model=Net(), config=CONFIG)
    assert optimizer is None and fz.memory_report(engine.state).opt == 0
    x, y = _batches(1)[0]
    engine.eval()
    assert engine(x, y).item() == pytest.approx(Net()(x, y).item(), rel=1e-6)
    engine.train()
    with pytest.raises(fz.ConfigError, match="deepspeed.initialize was given no optimizer .* for inference"):
        engine.backward(engine(x, y))


def test_a_client_scheduler_cycling_momentum_is_refused():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=10)  # cycle_momentum=True by default
    with pytest.raises(fz.ConfigError,
                       match=r"lr_scheduler=...\): OneCycleLR\(cycle_momentum=True\): fz follows a client scheduler"):
        deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=CONFIG)


def test_engine_state_dict_keys_are_deepspeeds_and_load_back():
    model = Net()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_sgd(0))
    sd = engine.state_dict()
    assert sorted(sd) == sorted(f"module.{k}" for k in model.state_dict())
    assert sorted(engine.module_state_dict()) == sorted(model.state_dict())
    _train(engine, _batches(2))
    engine.load_state_dict(sd)  # the weights before training, into the State
    assert all(torch.equal(v, sd[f"module.{k}"]) for k, v in fz.full_params(engine.state).items())


@pytest.mark.parametrize("stage", [0, 2])
def test_the_scripts_model_parameters_are_the_trained_ones_between_updates(stage):
    """At ZeRO 0-2 DeepSpeed trains the module's own parameters: an EMA over `model.parameters()`,
    as scripts keep one, reads each update's weights; a copy of the model (deepcopy, torch.save) is
    the model's, detached from the engine."""
    import copy
    import io

    model = Net()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config={**ADAM, "zero_optimization": {"stage": stage}})
    ema, want = copy.deepcopy(model), {n: p.detach().clone() for n, p in Net().named_parameters()}
    for x, y in _batches(3):
        engine.backward(engine(x, y))
        engine.step()
        trained = fz.full_params(engine.state)
        with torch.no_grad():
            for (n, a), b in zip(ema.named_parameters(), model.parameters()):
                assert torch.equal(b, trained[n])
                a.mul_(0.5).add_(b, alpha=0.5)
                want[n] = want[n] * 0.5 + trained[n] * 0.5
    assert all(torch.allclose(p, want[n], rtol=0, atol=1e-7) for n, p in ema.named_parameters())
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert all(torch.equal(p, trained[n]) for n, p in loaded.named_parameters())
    engine.destroy()
    assert "named_parameters" not in model.__dict__


def test_a_boundary_set_by_the_script_holds_until_it_is_set_again():
    """DeepSpeed's set_gradient_accumulation_boundary(True) stays: every step() then updates."""
    engine, *_ = deepspeed.initialize(model=Net(), config={**ADAM, "gradient_accumulation_steps": 2})
    engine.set_gradient_accumulation_boundary(True)
    for x, y in _batches(4):
        engine.backward(engine(x, y))
        engine.step()
    assert engine.global_steps == 4 and engine.is_gradient_accumulation_boundary()
    engine.set_gradient_accumulation_boundary(False)
    engine.backward(engine(*_batches(1)[0]))
    engine.step()
    assert engine.global_steps == 4
