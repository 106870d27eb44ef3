"""fz.optim transformations follow torch.optim on the same trajectory, sharded or not."""
from __future__ import annotations

import pytest
import torch

import fz
from fz.testing.gpt import lm_loss
from fz.testing.spawn import run_ranks

from support.helpers import make_model, max_rel, params_rel, rank_batches

STEPS = 6

CASES = {
    "sgd": (lambda: fz.optim.sgd(lr=0.05), lambda p: torch.optim.SGD(p, lr=0.05)),
    "sgd_momentum_wd": (
        lambda: fz.optim.sgd(lr=0.05, momentum=0.9, weight_decay=0.01),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
    ),
    "sgd_nesterov": (
        lambda: fz.optim.sgd(lr=0.05, momentum=0.9, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    ),
    "adam_l2": (
        lambda: fz.optim.adam(lr=1e-2, weight_decay=0.1),
        lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1),
    ),
    "clip_chain": (
        lambda: fz.optim.chain(fz.optim.clip_by_global_norm(0.5), fz.optim.adamw(lr=1e-2)),
        lambda p: torch.optim.AdamW(p, lr=1e-2),
    ),
}


def _torch_run(name, world):
    model = make_model()
    opt = CASES[name][1](model.parameters())
    losses = []
    for per_rank in rank_batches(world, 1, STEPS):
        opt.zero_grad()
        loss = lm_loss(model, torch.cat(per_rank))
        loss.backward()
        if name == "clip_chain":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def _fz_runs(rank, world, stages):
    out = {}
    for name in CASES:
        for stage in stages:
            state = fz.init(make_model(), fz.Spec(stage=stage, optimizer=CASES[name][0](), loss_fn=lm_loss))
            losses = []
            for per_rank in rank_batches(world, 1, STEPS):
                state, loss = fz.train_step(state, per_rank[rank])
                losses.append(float(loss))
            out[name, stage] = (losses, fz.full_params(state))
    return out


@pytest.mark.parametrize("world, stages", [(1, (0, 3)), (2, (0, 3))])
def test_optimizers_match_torch(world, stages):
    results = [_fz_runs(0, 1, stages)] if world == 1 else run_ranks(world, _fz_runs, stages, timeout=300)
    for name in CASES:
        want_losses, want_params = _torch_run(name, world)
        for stage in stages:
            for res in results:
                losses, params = res[name, stage]
                assert max_rel(losses, want_losses) < 1e-5, (name, stage)
                assert params_rel(params, want_params) < 1e-5, (name, stage)


def test_global_norm_counts_every_shard_once():
    g = {"a": torch.full((3, 4), 2.0), "b": torch.full((5,), -1.0)}
    assert float(fz.optim.global_norm(g)) == pytest.approx((12 * 4 + 5) ** 0.5)
    assert float(fz.optim.global_norm(g, norm_sq=lambda t: torch.tensor(100.0))) == pytest.approx(10.0)
    # the reduction reaches a transformation explicitly, as optax's extra args
    clipped, _ = fz.optim.clip_by_global_norm(1.0).update(g, (), None, norm_sq=lambda t: torch.tensor(100.0))
    assert torch.allclose(clipped["a"], g["a"] / 10.0, rtol=1e-5)


def test_fused_adamw_equals_its_chain():
    """adamw's fused fast path and the plain chain it stands for train alike (stage 0 and 3)."""
    for stage in (0, 3):
        runs = []
        for opt in (fz.optim.adamw(lr=1e-2, weight_decay=0.1),
                    fz.optim.chain(fz.optim.adamw(lr=1e-2, weight_decay=0.1))):  # chain(): no fused path
            state = fz.init(make_model(), fz.Spec(stage=stage, optimizer=opt, loss_fn=lm_loss, clip_grad_norm=1.0))
            losses = []
            for per_rank in rank_batches(1, 1, STEPS):
                state, loss = fz.train_step(state, per_rank[0])
                losses.append(float(loss))
            runs.append((losses, fz.full_params(state), fz.optim.current_lr(state.opt_state)))
        assert type(fz.optim.adamw()).step is not fz.optim.GradientTransformation.step  # adamw's own fused step
        assert runs[1] and runs[0][2] == runs[1][2] == 1e-2
        assert max_rel(runs[0][0], runs[1][0]) < 1e-6
        assert params_rel(runs[0][1], runs[1][1]) < 1e-6
