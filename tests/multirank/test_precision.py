"""bf16/fp16 training, fp16 loss scaling and activation checkpointing."""
from __future__ import annotations

import pytest
import torch

import fz
from fz.sharding.comm import Comm
from fz.testing.gpt import lm_loss

from support.helpers import make_model, max_rel, params_rel, rank_batches, reference, spec
from support.ranks import cached_runs

STAGES = (0, 1, 2, 3)


def _overflow_loss(model, batch):
    """The usual loss, except a batch whose first token is -1 overflows fp16 gradients."""
    poison = bool(batch[0, 0] < 0)
    loss = lm_loss(model, batch.clamp_min(0))
    return loss * 1e30 if poison else loss


def _runs(rank, world):
    out = {}
    for precision in ("bf16", "fp16"):
        for stage in STAGES:
            state = fz.init(make_model(), spec(stage, 1, precision=precision))
            losses = []
            for per_rank in rank_batches(world, 1):
                state, loss = fz.train_step(state, per_rank[rank])
                losses.append(float(loss))
            out[precision, stage] = (losses, fz.full_params(state), fz.memory_report(state).as_dict())
    # gradients reduced in bf16 (DeepSpeed's communication_data_type): half the reduce bytes
    for reduce_dtype in ("fp32", "bf16"):
        state = fz.init(make_model(), spec(2, 1, precision="bf16", reduce_dtype=reduce_dtype))
        losses = []
        for per_rank in rank_batches(world, 1):
            state, loss = fz.train_step(state, per_rank[rank])
            losses.append(float(loss))
        out["reduce", reduce_dtype] = (losses, fz.comm_report(state).payload)
    # fp16: a poisoned batch on rank 0 only must skip the step on every rank
    state = fz.init(make_model(), spec(3, 1, precision="fp16", loss_fn=_overflow_loss))
    batches = rank_batches(world, 1, 12)
    state, _ = fz.train_step(state, batches[0][rank])
    before = (fz.full_params(state), {k: v.full_tensor() for k, v in state.master.items()},
              float(state.opt_state[0].mu["wte.weight"].full_tensor().norm()), dict(state.scaler))
    poisoned = batches[1][rank].clone()
    if rank == 0:
        poisoned[0, 0] = -1
    state, _ = fz.train_step(state, poisoned)
    after = (fz.full_params(state), {k: v.full_tensor() for k, v in state.master.items()},
             float(state.opt_state[0].mu["wte.weight"].full_tensor().norm()), dict(state.scaler))
    losses = []
    for per_rank in batches[2:]:
        state, loss = fz.train_step(state, per_rank[rank])
        losses.append(float(loss))
    out["overflow"] = (before, after, losses, int(state.step), dict(state.scaler))
    return out


@pytest.fixture(scope="module")
def results():
    return cached_runs(2, _runs, timeout=400)


def test_low_precision_follows_fp32_reference(results):
    want, _ = reference(2, 1)
    for precision in ("bf16", "fp16"):
        for stage in STAGES:
            for res in results:
                losses, _, _ = res[precision, stage]
                assert max_rel(losses, want) < 2e-2, (precision, stage, losses, want)


def test_stages_agree_exactly_in_the_same_precision(results):
    for precision in ("bf16", "fp16"):
        base_losses, base_params, _ = results[0][precision, 0]
        for stage in STAGES:
            for res in results:
                losses, params, _ = res[precision, stage]
                assert losses == base_losses, (precision, stage)
                for k in base_params:
                    assert torch.equal(params[k], base_params[k]), (precision, stage, k)


def test_gradients_can_be_reduced_in_bf16(results):
    want, _ = reference(2, 1)
    losses32, payload32 = results[0]["reduce", "fp32"]
    losses16, payload16 = results[0]["reduce", "bf16"]
    assert max_rel(losses16, want) < 2e-2  # (at world 2, a bf16 sum of two bf16 values is exact anyway)
    reduced = lambda p: p.get("all_reduce", 0) + p.get("reduce_scatter", 0)  # noqa: E731
    assert reduced(payload16) * 2 == reduced(payload32)


def test_mixed_precision_memory_formula(results):
    psi = sum(p.numel() for p in make_model().parameters())
    n = 2
    formula = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}
    for precision in ("bf16", "fp16"):
        for stage in STAGES:
            rep = results[0][precision, stage][2]
            assert rep["formula_total"] == pytest.approx(formula[stage]), (precision, stage)
            assert rep["total"] == rep["formula_total"], (precision, stage, rep)


def test_fp16_overflow_skips_the_step_on_every_rank(results):
    for res in results:
        before, after, losses, steps, scaler = res["overflow"]
        p0, m0, mu0, s0 = before
        p1, m1, mu1, s1 = after
        for k in m0:  # full_params also names the tied head; the master only its canonical name
            assert torch.equal(p0[k], p1[k]) and torch.equal(m0[k], m1[k]), k
        assert mu0 == mu1
        assert float(s1["scale"]) == float(s0["scale"]) and int(s1["hysteresis"]) == int(s0["hysteresis"]) - 1
        assert int(s1["skipped"]) == 1 and int(s0["skipped"]) == 0
        assert steps == 12 and all(torch.isfinite(torch.tensor(losses)))
        assert losses[-1] < losses[0]  # training goes on and converges
    assert results[0]["overflow"][2] == results[1]["overflow"][2]


def test_dynamic_loss_scale_follows_deepspeed():
    from fz.step.scaler import init_scaler, update_scaler
    sp = fz.Spec(precision="fp16", loss_scaling=fz.LossScale(initial_scale_power=4, loss_scale_window=2,
                                                             hysteresis=2, min_loss_scale=2.0))
    s = init_scaler(sp)
    seen = []
    for overflow in [False, False, True, True, True, False, False, True, True, True, True]:
        s = update_scaler(sp, s, overflow)
        seen.append(float(s["scale"]))
    # DeepSpeed 0.19.8's DynamicLossScaler on this sequence (its update_scale, run with the same
    # settings): a clean run doubles once 2 steps have passed after the one that follows the last
    # overflow; the 2nd overflow in a row halves (hysteresis 2, not restored without a growth)
    assert seen == [16, 16, 16, 8, 4, 4, 4, 2, 2, 2, 2]
    assert int(s["skipped"]) == 7
    clean = fz.Spec(precision="fp16", loss_scaling=fz.LossScale(initial_scale_power=4, loss_scale_window=3))
    s, seen = init_scaler(clean), []
    for _ in range(8):
        s = update_scaler(clean, s, False)
        seen.append(float(s["scale"]))
    assert seen == [16, 16, 16, 32, 32, 32, 64, 64]  # DeepSpeed: the 4th clean step, then every 3rd


def test_the_trainers_fp16_scale_grows_as_grad_scaler():
    """torch.amp.GradScaler doubles at every growth_interval-th clean step in a row (the Trainer's fp16)."""
    from fz.step.scaler import init_scaler, update_scaler
    sp = fz.Spec(precision="fp16", loss_scaling=fz.LossScale(initial_scale_power=4, loss_scale_window=3,
                                                             hysteresis=1, growth="grad_scaler"))
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=3)
    scaler.scale(torch.ones(()))  # makes its scale and growth tracker
    s, ours, theirs = init_scaler(sp), [], []
    for overflow in [False, False, False, False, True, False, False, False, False, False, False]:
        s = update_scaler(sp, s, overflow)
        ours.append(float(s["scale"]))
        found = torch.tensor(float(overflow))
        torch._amp_update_scale_(scaler._scale, scaler._growth_tracker, found, scaler._growth_factor,
                                 scaler._backoff_factor, scaler._growth_interval)
        theirs.append(float(scaler._scale))
    assert ours == theirs


def _saved_bytes(checkpointing: bool, stage: int):
    state = fz.init(make_model(), spec(stage, 1, activation_checkpointing=checkpointing))
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    base_loss = state.spec.loss_fn

    def counting_loss(model, batch):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return base_loss(model, batch)

    state = state.replace(spec=state.spec.replace(loss_fn=counting_loss))
    for per_rank in rank_batches(1, 1, 3):
        state, _ = fz.train_step(state, per_rank[0])
    return saved[0], fz.full_params(state)


@pytest.mark.parametrize("stage", [0, 3])
def test_activation_checkpointing_same_result_less_memory(stage):
    plain_bytes, plain = _saved_bytes(False, stage)
    ckpt_bytes, ckpt = _saved_bytes(True, stage)
    assert params_rel(ckpt, plain) < 1e-6
    if stage == 0:  # (stage 3 saves through its own hooks, which this outer counter cannot see)
        assert ckpt_bytes < 0.6 * plain_bytes, (ckpt_bytes, plain_bytes)
    # a name policy: checkpoint only block 1
    state = fz.init(make_model(), spec(stage, 1, activation_checkpointing=["blocks.1"]))
    runner = fz.step.runner.Runner(state.skeleton, state.plan, Comm(state.plan), [], {}, state.spec)
    assert runner.checkpointed == [False, False, True]
