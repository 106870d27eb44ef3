"""Mixtral's load-balancing loss (router logits recorded by transformers' hooks) at world 2,
stages 0 and 3, against the single-process reference that runs each rank's rows on their own."""
from __future__ import annotations

import warnings

import pytest

import fz

from support.helpers import max_rel
from support.ranks import cached_runs
from support.real_nets import hf_loss, hf_model, reference, tokens

pytest.importorskip("transformers")


def _mixtral():
    return hf_model("mixtral")


def _runs(rank, world):
    warnings.filterwarnings("ignore")
    out = {}
    for stage in (0, 3):
        state = fz.init(_mixtral(), fz.Spec(stage=stage, optimizer=fz.optim.adamw(lr=1e-2, weight_decay=0.01),
                                            loss_fn=hf_loss))
        losses = []
        for i in range(2):
            state, loss = fz.train_step(state, {k: v.chunk(world)[rank] for k, v in tokens(i, 8, "mixtral").items()})
            losses.append(float(loss))
        out[stage] = losses
    return out


def test_mixtral_with_router_logits_follows_the_reference_at_world_2():
    want, _ = reference(_mixtral, hf_loss, [tokens(i, 8, "mixtral") for i in range(2)], 2)
    for rank, res in enumerate(cached_runs(2, _runs, timeout=300)):
        for stage in (0, 3):
            assert max_rel(res[stage], want) < 1e-5, (stage, rank, res[stage], want)
