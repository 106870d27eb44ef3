"""Every ZeRO stage at world sizes 1, 2, 4 follows the plain single-process trajectory."""
from __future__ import annotations

import pytest

import fz
from fz.testing.spawn import run_ranks
from helpers import max_rel, params_rel, reference, train_fz

STAGES = (0, 1, 2, 3)
ACCUMS = (1, 2)
TOL = 1e-5


def _all_configs(rank: int, world: int):
    out = {}
    for stage in STAGES:
        for ga in ACCUMS:
            state, losses = train_fz(rank, world, stage, ga)
            full = {k: v for k, v in fz.full_params(state).items()}
            out[(stage, ga)] = (losses, full, fz.memory_report(state).as_dict())
    return out


def _check(results_by_rank, world):
    for ga in ACCUMS:
        want_losses, want_params = reference(world, ga)
        for stage in STAGES:
            for rank, res in enumerate(results_by_rank):
                losses, full, _ = res[(stage, ga)]
                assert max_rel(losses, want_losses) < TOL, (world, stage, ga, rank, losses, want_losses)
                assert params_rel(full, want_params) < TOL, (world, stage, ga, rank)


def test_world1_in_process():
    _check([_all_configs(0, 1)], 1)


@pytest.mark.parametrize("world", [2, 4])
def test_world_n(world):
    _check(run_ranks(world, _all_configs, timeout=300), world)
