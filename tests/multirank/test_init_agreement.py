"""Ranks that disagree on the spec or the model are told at fz.init, on every rank, naming what
differs (before any collective depends on it), not at a hang or a size error later."""
from __future__ import annotations

import pytest

import fz
from fz.testing.gpt import GPTConfig
from fz.testing.spawn import run_ranks

from support.helpers import CFG, config_error, make_model, spec


def _job(rank, world, root):
    import os
    os.makedirs(f"{root}/nvme{rank}", exist_ok=True)
    wider = GPTConfig(vocab=CFG.vocab, seq=CFG.seq, dim=CFG.dim + 8 * rank, heads=CFG.heads, layers=CFG.layers)
    return {
        "stage": config_error(lambda: fz.init(make_model(), spec(3 if rank else 2, 1))),
        "shapes": config_error(lambda: fz.init(make_model(cfg=wider), spec(3, 1))),
        "path": config_error(lambda: fz.init(make_model(), spec(3, 1, offload=fz.offload.nvme(f"{root}/nvme{rank}")))),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(2, _job, str(tmp_path_factory.mktemp("agree")), timeout=120)


def test_a_different_spec_field_is_named_on_every_rank(results):
    for res in results:
        assert "differ between ranks (the spec or the model)" in res["stage"], res["stage"]
        assert "Spec.stage: rank(s) [1] differ from rank 0" in res["stage"], res["stage"]


def test_a_different_model_is_named_on_every_rank(results):
    for res in results:
        assert "the model's parameter shapes: rank(s) [1] differ from rank 0" in res["shapes"], res["shapes"]


def test_per_rank_offload_paths_are_allowed(results):
    assert [res["path"] for res in results] == ["", ""]
