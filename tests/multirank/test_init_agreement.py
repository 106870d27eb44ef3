"""Ranks that disagree on the spec or the model are told at fz.init, on every rank, naming what
differs (before any collective depends on it), not at a hang or a size error later."""
from __future__ import annotations

import pytest

import fz
from fz.testing.gpt import GPTConfig
from fz.testing.spawn import run_ranks

from support.helpers import CFG, config_error, make_model, spec


def _job(rank, world):
    wider = GPTConfig(vocab=CFG.vocab, seq=CFG.seq, dim=CFG.dim + 8 * rank, heads=CFG.heads, layers=CFG.layers)
    return {
        "stage": config_error(lambda: fz.init(make_model(), spec(3 if rank else 2, 1))),
        "shapes": config_error(lambda: fz.init(make_model(cfg=wider), spec(3, 1))),
        "log_dir": config_error(lambda: fz.init(make_model(), spec(3, 1, log_dir="runs" if rank == 0 else None))),
    }


@pytest.fixture(scope="module")
def results():
    return run_ranks(2, _job, timeout=120)


def test_a_different_spec_field_is_named_on_every_rank(results):
    for res in results:
        assert "differ between ranks (the spec or the model)" in res["stage"], res["stage"]
        assert "Spec.stage: rank(s) [1] differ from rank 0" in res["stage"], res["stage"]


def test_a_different_model_is_named_on_every_rank(results):
    for res in results:
        assert "the model's parameter shapes: rank(s) [1] differ from rank 0" in res["shapes"], res["shapes"]


def test_per_rank_log_dirs_are_allowed(results):
    assert [res["log_dir"] for res in results] == ["", ""]
