"""A crash at any point of an fz.hf.Trainer save never leaves a folder that resume picks (issue 39).

One world-2 run (ZeRO-3, 8 steps, a save every 2) is killed, resumed with
`resume_from_checkpoint=True`, killed again further on, and so on: rank 1 SIGKILLs itself as
fz's checkpoint of checkpoint-4 is written, rank 0 right after that checkpoint's commit at
checkpoint-6, rank 0 as trainer_state.json of checkpoint-8 is written. Each resume starts from
the last complete checkpoint and trains past the step where the run died; the last one ends
the run with every step's loss and the final weights of an uninterrupted run, bit for bit.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from fz.testing.spawn import run_ranks  # noqa: E402

from support.hf_crash_jobs import STEPS, train  # noqa: E402

pytestmark = pytest.mark.slow  # the slow tier: .ci/run runs it (-m slow)

CRASHES = [(4, 1, "fz_write"), (6, 0, "fz_commit"), (8, 0, "state_json")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf_crash")
    whole = run_ranks(2, train, str(base / "whole"), None, False, timeout=300)
    out, seen = str(base / "crashed"), []
    for i, kill in enumerate(CRASHES):
        with pytest.raises(RuntimeError, match=f"rank {kill[1]} exited|PeerError"):  # the killed rank, or its peer
            run_ranks(2, train, out, kill, i > 0, timeout=300)
        seen.append(sorted(os.listdir(out)))
    last = run_ranks(2, train, out, None, True, timeout=300)
    return whole, last, seen


def test_a_crashed_save_leaves_only_a_staging_folder(runs):
    _, _, seen = runs
    assert "tmp-checkpoint-4" in seen[0] and "checkpoint-4" not in seen[0] and "checkpoint-2" in seen[0]
    assert "tmp-checkpoint-6" in seen[1] and "checkpoint-6" not in seen[1] and "checkpoint-4" in seen[1]
    assert "tmp-checkpoint-4" not in seen[1]  # cleared by the next save of step 4
    assert "tmp-checkpoint-8" in seen[2] and "checkpoint-6" in seen[2]


def test_resumed_after_every_crash_the_run_is_the_uninterrupted_one_bit_for_bit(runs):
    whole, last, _ = runs
    for w, r in zip(whole, last):
        assert w["steps"] == list(range(1, STEPS + 1)) and r["steps"] == w["steps"]
        assert r["losses"] == w["losses"]  # steps 1-6 from the checkpoints' histories, 7-8 trained now
        assert all(torch.equal(r["weights"][k], v) for k, v in w["weights"].items())
    assert [n for n in last[0]["listing"] if n.startswith(("checkpoint-", "tmp-"))] == \
        ["checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8"]
