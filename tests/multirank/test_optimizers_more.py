"""Lion, Adafactor and LAMB on shards follow an unsharded reference for 10 steps.

Adafactor's reference is torch.optim.Adafactor (and transformers' Adafactor); Lion and LAMB have none in torch, so the
reference is the plain whole-tensor algorithm (Lion's in support/helpers.py, LAMB's below;
DeepSpeed FusedLion / FusedLamb semantics). Each runs at world 1 and 2, ZeRO stages 0 and 3, through
fz.init / fz.train_step; a schedule rides along and `current_lr` must report it.
"""
from __future__ import annotations

import math

import pytest
import torch

import fz
from fz.testing.gpt import lm_loss
from fz.testing.spawn import run_ranks

from support.helpers import LionRef, make_model, max_rel, params_rel, rank_batches

STEPS = 10
WARMUP = fz.optim.WarmupLR(warmup_min_lr=0.0, warmup_max_lr=3e-3, warmup_num_steps=4, warmup_type="linear")


class LambRef(torch.optim.Optimizer):
    """LAMB on whole tensors: bias-corrected Adam direction + decay, trust ratio clamped."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, max_coeff=10.0, min_coeff=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      max_coeff=max_coeff, min_coeff=min_coeff))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                st["t"] += 1
                t = st["t"]
                st["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m_hat, v_hat = st["m"] / (1 - b1**t), st["v"] / (1 - b2**t)
                u = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = float(p.norm()), float(u.norm())
                trust = 1.0 if w_norm == 0 or u_norm == 0 else min(max(w_norm / u_norm, group["min_coeff"]),
                                                                    group["max_coeff"])
                p.add_(u, alpha=-group["lr"] * trust)


CASES = {
    "lion": (lambda: fz.optim.lion(lr=WARMUP, betas=(0.9, 0.99), weight_decay=0.1),
             lambda ps: LionRef(ps, lr=0.0, betas=(0.9, 0.99), weight_decay=0.1)),
    "adafactor": (lambda: fz.optim.adafactor(lr=1e-2, weight_decay=0.01),
                  lambda ps: torch.optim.Adafactor(ps, lr=1e-2, weight_decay=0.01, foreach=False)),
    "adafactor_warmup": (lambda: fz.optim.adafactor(lr=fz.optim.linear(0.02, 0.005, 10)),
                         lambda ps: torch.optim.Adafactor(ps, lr=0.02, foreach=False)),
    "lamb": (lambda: fz.optim.lamb(lr=WARMUP, eps=1e-6, weight_decay=0.01),
             lambda ps: LambRef(ps, lr=0.0, eps=1e-6, weight_decay=0.01)),
}
try:  # transformers' own Adafactor (TrainingArguments.optim="adafactor"): eps1 added to g^2, lr as the step
    from transformers.optimization import Adafactor as HfAdafactor
    CASES["adafactor_transformers"] = (
        lambda: fz.optim.adafactor(lr=1e-2, eps=(1e-30, 1e-3), capped_lr=False, scale_by_rms=False, eps1_added=True),
        lambda ps: HfAdafactor(ps, lr=1e-2, scale_parameter=False, relative_step=False, warmup_init=False))
except ImportError:
    pass
# transformers' Adafactor is itself this sensitive to rounding (a row of tiny gradients over eps1=1e-30
# is magnified): on this model its run differs by 1e-4 from the same run summing two half-batches'
# gradients, and by 1.1e-4 from its float64 run; torch's Adafactor by 2e-6 and 1e-6.
PARAMS_REL = {"adafactor_transformers": 3e-4}
SCHEDULES = {"lion": WARMUP, "lamb": WARMUP, "adafactor_warmup": fz.optim.linear(0.02, 0.005, 10)}


def _reference(name, world):
    model = make_model()
    opt = CASES[name][1](model.parameters())
    losses, lrs = [], []
    for step, per_rank in enumerate(rank_batches(world, 1, STEPS)):
        if name in SCHEDULES:
            for group in opt.param_groups:
                group["lr"] = SCHEDULES[name](step)
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        loss = lm_loss(model, torch.cat(per_rank))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.named_parameters()}, lrs


def _fz_runs(rank, world, stages):
    out = {}
    for name in CASES:
        for stage in stages:
            state = fz.init(make_model(), fz.Spec(stage=stage, optimizer=CASES[name][0](), loss_fn=lm_loss))
            losses, lrs = [], []
            for per_rank in rank_batches(world, 1, STEPS):
                state, loss = fz.train_step(state, per_rank[rank])
                losses.append(float(loss))
                lrs.append(fz.optim.current_lr(state.opt_state))
            out[name, stage] = (losses, fz.full_params(state), lrs)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_optimizers_match_reference(world):
    stages = (0, 3)
    results = [_fz_runs(0, 1, stages)] if world == 1 else run_ranks(world, _fz_runs, stages, timeout=300)
    for name in CASES:
        want_losses, want_params, want_lrs = _reference(name, world)
        for stage in stages:
            for res in results:
                losses, params, lrs = res[name, stage]
                assert max_rel(losses, want_losses) < 1e-5, (name, stage, losses, want_losses)
                assert params_rel(params, want_params) < PARAMS_REL.get(name, 1e-5), (name, stage)
                assert lrs == pytest.approx(want_lrs, rel=1e-12, abs=0), (name, stage)


def test_adafactor_factors_only_matrices_and_keeps_columns_whole():
    opt = fz.optim.adafactor()
    params = {"w": torch.ones(6, 4), "b": torch.ones(4), "t": torch.ones(2, 3, 5)}
    state = opt.init(params)
    assert set(state.v_rows) == {"w", "t"} and set(state.v) == {"b"}
    assert state.v_rows["w"].shape == (6,) and state.v_cols["w"].shape == (4,)
    assert state.v_rows["t"].shape == (2, 3) and state.v_cols["t"].shape == (2, 5)


def test_adafactor_column_statistic_sums_over_all_shards():
    """Two row shards with `sum_across_shards` bound to add their partial sums = the whole."""
    torch.manual_seed(0)
    w, g = torch.randn(6, 4), torch.randn(6, 4)
    whole = fz.optim.adafactor(lr=0.01)
    u_whole, _ = whole.update({"w": g.clone()}, whole.init({"w": w}), {"w": w})

    halves = [fz.optim.adafactor(lr=0.01) for _ in range(2)]
    states = [h.init({"w": w[i * 3:(i + 1) * 3]}) for i, h in enumerate(halves)]
    # Run both halves in lockstep: each sum_across_shards call returns the two partials added.
    import threading
    barrier, box = threading.Barrier(2), [None, None]

    def summed(i):
        def fn(tree):
            box[i] = tree
            barrier.wait()
            total = {k: box[0][k] + box[1][k] for k in tree}
            barrier.wait()
            return total
        return fn

    outs = [None, None]

    def run(i):
        rows = slice(i * 3, (i + 1) * 3)
        outs[i], _ = halves[i].update({"w": g[rows].clone()}, states[i], {"w": w[rows]}, shard_sum=summed(i))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    torch.testing.assert_close(torch.cat([outs[0]["w"], outs[1]["w"]]), u_whole["w"])


def test_lamb_trust_ratio_is_clamped_and_one_for_zero_params():
    opt = fz.optim.scale_by_lamb(max_coeff=10.0, min_coeff=0.01)
    params = {"big": torch.full((4,), 1e6), "zero": torch.zeros(4), "tiny": torch.full((4,), 1e-9)}
    grads = {k: torch.ones(4) for k in params}
    u, _ = opt.update({k: g.clone() for k, g in grads.items()}, opt.init(params), params)
    adam_dir = torch.ones(4) / (1 + 1e-8)  # first step: m_hat / (sqrt(v_hat) + eps) = 1 / (1 + eps)
    torch.testing.assert_close(u["big"], 10.0 * adam_dir)  # ratio 5e5 clamped to max_coeff
    torch.testing.assert_close(u["zero"], adam_dir)  # ||p|| = 0 -> trust 1
    torch.testing.assert_close(u["tiny"], 0.01 * adam_dir)  # ratio 1e-9 clamped to min_coeff


def test_lion_update_is_a_sign_and_current_lr_reads_the_state():
    opt = fz.optim.lion(lr=fz.optim.constant(0.5))
    params = {"p": torch.zeros(3)}
    state = opt.init(params)
    assert fz.optim.current_lr(state) == 0.5
    u, state = opt.update({"p": torch.tensor([2.0, -3.0, 0.0])}, state, params)
    assert u["p"].tolist() == [-0.5, 0.5, 0.0]
    assert math.isclose(fz.optim.current_lr(state), 0.5)
    with pytest.raises(ValueError, match="no learning rate"):
        fz.optim.current_lr(fz.optim.scale_by_adam().init(params))
