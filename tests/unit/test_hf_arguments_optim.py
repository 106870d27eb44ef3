"""fz.hf.arguments (issue 23), the optimizer and schedule: TrainingArguments' optim and
lr_scheduler_type give the updates Trainer.create_optimizer's torch optimizer makes, update by update,
and the lr of transformers.get_scheduler, step by step; fz.train_step with the Spec trains as the
Trainer's inner loop. Single process, CPU. The DeepSpeed config's "auto" fill, mismatches and the
settings fz cannot honour: test_hf_arguments.py.
"""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate.utils.deepspeed")  # as test_hf_arguments.py: both or neither run

import fz  # noqa: E402
from fz.hf.arguments import spec_from_args  # noqa: E402
from fz.hf.optimizers import SCHEDULES  # noqa: E402

from support.helpers import LionRef  # noqa: E402
from support.hf_args import STEPS, Tiny, make_args, quiet  # noqa: E402

# --- optim: the update Trainer.create_optimizer's torch optimizer makes -----------------------------------------

def _trainer_groups(args, model) -> list[dict]:
    """Trainer.create_optimizer's parameter groups: decay, and none for biases and norms."""
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    return [{"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": args.weight_decay},
            {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}]


def _trainer_optimizer(args, model):
    """Trainer.create_optimizer, without a Trainer: its groups, its class and kwargs."""
    groups = _trainer_groups(args, model)
    cls, kw = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
    return cls(groups, **kw)


def _lion_reference(args, model):
    """bitsandbytes' Lion (optim="lion_32bit"; bitsandbytes is not installed here) on Trainer's groups."""
    return LionRef(_trainer_groups(args, model), args.learning_rate, (args.adam_beta1, args.adam_beta2))


@pytest.mark.parametrize("optim, extra", [("adamw_torch", {}), ("adamw_torch_fused", {}), ("sgd", {}),
                                          ("sgd", {"optim_args": "momentum=0.9,nesterov=true"}),
                                          ("adafactor", {}), ("lion_32bit", {"learning_rate": 1e-3})])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_optimizer_updates_equal_the_trainers(optim, extra, weight_decay, tmp_path):
    args = make_args(tmp_path, optim=optim, weight_decay=weight_decay, warmup_steps=2,
                     **{"learning_rate": 1e-2, **extra})
    torch.manual_seed(0)
    model = Tiny()
    theirs_model = copy.deepcopy(model)
    spec = spec_from_args(args, model, max_steps=8)
    theirs = (_lion_reference if optim == "lion_32bit" else _trainer_optimizer)(args, theirs_model)
    sched = transformers.get_scheduler("linear", theirs, num_warmup_steps=2, num_training_steps=8)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = spec.optimizer.init(params)
    for step in range(6):  # small gradients (|g| ~ 1e-4, real models have them) then 1, rows with none
        grads = {n: torch.randn_like(p) * (1e-4 if step < 4 else 1.0) for n, p in params.items()}
        for g in grads.values():
            g[: len(g) // 2] = 0 if step % 2 and g.dim() > 1 else g[: len(g) // 2]
        for n, p in theirs_model.named_parameters():
            p.grad = grads[n].clone()
        theirs.step()
        sched.step()
        u, state = spec.optimizer.update(grads, state, params)
        fz.optim.apply_updates(params, u)
        for n, p in theirs_model.named_parameters():
            torch.testing.assert_close(params[n], p.detach(), rtol=1e-5, atol=1e-6, msg=n)
    decays = spec.provenance["optimizer"][0]
    assert f"optim={optim!r}" in decays and (("get_decay_parameter_names" in decays) == (weight_decay > 0))


def test_weight_decay_skips_biases_and_norms(tmp_path):
    """Only get_decay_parameter_names decay (lin.weight, head.weight): zero gradients show it."""
    args = make_args(tmp_path, optim="adamw_torch", weight_decay=0.5, learning_rate=0.1, lr_scheduler_type="constant")
    model = Tiny()
    spec = spec_from_args(args, model, max_steps=4)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    u, _ = spec.optimizer.update({n: torch.zeros_like(p) for n, p in params.items()},
                                 spec.optimizer.init(params), params)
    moved = {n for n, t in u.items() if t.abs().sum() > 0}
    assert moved == {"lin.weight", "head.weight"}


# --- lr_scheduler_type: the lr of each step equals transformers.get_scheduler's ------------------------------

@pytest.mark.parametrize("kind, kwargs", [("linear", {}), ("cosine", {}), ("cosine", {"num_cycles": 1.5}),
                                          ("constant", {}), ("constant_with_warmup", {}), ("polynomial", {}),
                                          ("polynomial", {"power": 2.0, "lr_end": 1e-5})])
@pytest.mark.parametrize("warmup", [0, 5, 0.2])
def test_schedules_equal_get_scheduler(kind, kwargs, warmup, tmp_path):
    args = make_args(tmp_path, lr_scheduler_type=kind, lr_scheduler_kwargs=kwargs, warmup_steps=warmup,
                     learning_rate=2e-3)
    total = 16
    spec = spec_from_args(args, Tiny(), max_steps=total)
    schedule = spec.provenance["scheduler"][0]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
    theirs = transformers.get_scheduler(kind, opt, num_warmup_steps=args.get_warmup_steps(total),
                                        num_training_steps=total, scheduler_specific_kwargs=kwargs)
    for k in range(STEPS + 4):  # past the end too
        assert schedule(k) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-18), k
        opt.step()
        theirs.step()
    assert set(SCHEDULES) == {"linear", "cosine", "constant", "constant_with_warmup", "polynomial",
                              "reduce_lr_on_plateau"}  # the last stepped by the evaluation: test_hf_plateau.py


def test_a_deepspeed_optimizer_runs_the_trainers_schedule(tmp_path):
    """An optimizer section without a scheduler section: the Trainer's lr_scheduler_type on it."""
    cfg = {"optimizer": {"type": "SGD", "params": {"lr": "auto"}}}
    args = make_args(tmp_path, lr_scheduler_type="cosine", warmup_steps=3, learning_rate=0.1, deepspeed=cfg)
    spec = quiet(spec_from_args, args, Tiny(), max_steps=10)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    theirs = transformers.get_scheduler("cosine", opt, num_warmup_steps=3, num_training_steps=10)
    schedule = spec.provenance["scheduler"][0]
    for k in range(12):
        assert schedule(k) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-18)
        opt.step()
        theirs.step()
    assert spec.provenance["optimizer"][0].startswith("fz.optim.sgd")  # the section's optimizer, not optim=


@pytest.mark.parametrize("stage", [0, 3])
def test_the_spec_trains_as_the_trainers_loop(stage, tmp_path):
    """fz.train_step with the Spec == the Trainer's inner loop (clip, AdamW on its two groups, linear schedule)
    on a tiny GPT-2, one process: the decay mask holds on fz's own parameter names, at stage 3 too."""
    cfg = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    theirs_model = copy.deepcopy(model)
    args = make_args(tmp_path, optim="adamw_torch", weight_decay=0.5, learning_rate=1e-2, warmup_steps=1,
                     per_device_train_batch_size=4, max_grad_norm=0.5)
    spec = spec_from_args(args, model, max_steps=5, spec=fz.Spec(stage=stage, loss_fn=lambda m, b: m(**b).loss))
    state = fz.init(model, spec)
    theirs = _trainer_optimizer(args, theirs_model)
    sched = transformers.get_scheduler("linear", theirs, num_warmup_steps=1, num_training_steps=5)
    torch.manual_seed(1)
    for _ in range(4):
        ids = torch.randint(0, 64, (4, 8))
        state, loss = fz.train_step(state, {"input_ids": ids, "labels": ids})
        want = theirs_model(input_ids=ids, labels=ids).loss
        want.backward()
        torch.nn.utils.clip_grad_norm_(theirs_model.parameters(), 0.5)
        theirs.step()
        sched.step()
        theirs.zero_grad()
        assert float(loss) == pytest.approx(float(want.detach()), rel=1e-5)
    full = fz.full_params(state)
    for n, p in theirs_model.named_parameters():
        torch.testing.assert_close(full[n], p.detach(), rtol=1e-4, atol=1e-5, msg=n)
