"""Spec(skip_unused=True) at world 2 with experts inside a block (every rank calls the same
blocks): an expert that only rank 0 routes to moves as in torch, one no rank routes to stays,
at every stage."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import fz

from support.helpers import max_rel
from support.ranks import cached_runs
from support.real_nets import points, reference

STAGES, ROWS = (0, 1, 2, 3), 8


class Routed(nn.Module):
    """A block with experts inside: each row goes to the expert its `route` names."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, h, route):
        for e in sorted(set(route.tolist())):
            h = h + torch.tanh(self.experts[e](h)) * (route == e).float()[:, None]
        return h


class InsideMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList(Routed() for _ in range(2))
        self.out = nn.Linear(16, 1)

    def forward(self, x, route):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h, route)
        return self.out(h).squeeze(-1)


def _make():
    torch.manual_seed(0)
    return InsideMoE()


def _loss(model, batch):
    return F.mse_loss(model(batch["x"], batch["route"]), batch["y"])


def _data(step: int, rows: int) -> dict:
    """Rank 0's half routes to experts 0, 1, 2; rank 1's to 0 and 1: expert 2 is unused on rank 1,
    expert 3 everywhere."""
    out = points(step, rows)
    half = rows // 2
    out["route"] = torch.cat([torch.arange(half) % 3, torch.arange(half) % 2])
    return out


def _runs(rank, world):
    out = {}
    for stage in STAGES:
        spec = fz.Spec(stage=stage, optimizer=fz.optim.adamw(lr=1e-2, weight_decay=0.01), loss_fn=_loss,
                       skip_unused=True)
        state = fz.init(_make(), spec)
        losses = []
        for i in range(3):
            state, loss = fz.train_step(state, {k: v.chunk(world)[rank] for k, v in _data(i, world * ROWS).items()})
            losses.append(float(loss))
        out[stage] = (losses, fz.full_params(state))
    return out


def test_an_expert_unused_on_one_rank_moves_and_one_unused_everywhere_stays_at_every_stage():
    results = cached_runs(2, _runs, timeout=400)
    want, ref_sd = reference(_make, _loss, [_data(i, 2 * ROWS) for i in range(3)], 2)
    start = _make().state_dict()
    for stage in STAGES:
        for rank, res in enumerate(results):
            losses, full = res[stage]
            assert max_rel(losses, want) < 1e-5, (stage, rank, losses, want)
            for n in full:
                assert torch.allclose(full[n], ref_sd[n], rtol=1e-5, atol=1e-6), (stage, rank, n)
            assert torch.equal(full["layers.0.experts.3.weight"], start["layers.0.experts.3.weight"]), stage
            assert not torch.equal(full["layers.1.experts.2.weight"], start["layers.1.experts.2.weight"]), stage
