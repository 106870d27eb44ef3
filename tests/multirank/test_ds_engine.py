"""fz.deepspeed (issue 25): seed 003's DeepSpeed loop runs with `import fz.deepspeed as deepspeed`.

One world-2 run trains the loop at ZeRO 0-3 (saving at step 2 with a client state), resumes
each from its checkpoint in a new engine, and runs fz.train_step on the same batches. The
losses, lrs and weights are compared with the same loop under DeepSpeed 0.19.8 (CPU, gloo),
recorded in tests/data/deepspeed_seed003.json by `tests/support/ds_engine_jobs.py`; with
FZ_DEEPSPEED_PYTHON (a python with DeepSpeed) the record is made anew and compared too.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fz.testing.spawn import run_ranks

from support.ds_engine_jobs import ACCUM, SAVE_AT, fz_job

RECORD = Path(__file__).resolve().parents[1] / "data" / "deepspeed_seed003.json"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(2, fz_job, str(tmp_path_factory.mktemp("ds_engine")), timeout=300)


def _check_against(record: dict, runs) -> None:
    for stage in range(4):
        ds, got = record[str(stage)], runs[0][stage]["run"]
        assert got["stage"] == stage
        assert got["losses"] == pytest.approx(ds["losses"], rel=1e-5, abs=1e-6), f"stage {stage}"
        assert got["lrs"] == pytest.approx(ds["lrs"], rel=1e-12), f"stage {stage}"
        for name, w in ds["weights"].items():
            torch.testing.assert_close(got["weights"][name], torch.tensor(w), rtol=1e-5, atol=1e-6)


def test_losses_lrs_and_weights_equal_deepspeeds(runs):
    _check_against(json.loads(RECORD.read_text()), runs)


def test_resume_from_save_checkpoint_is_bit_identical(runs):
    for rank in runs:
        for stage in range(4):
            run, resumed = rank[stage]["run"], rank[stage]["resumed"]
            assert resumed["losses"] == run["losses"][SAVE_AT * ACCUM:], f"stage {stage}"
            assert resumed["global_steps"] == run["global_steps"] == 4
            for name, w in run["weights"].items():
                assert torch.equal(resumed["weights"][name], w), (stage, name)


def test_engine_step_is_train_steps_step(runs):
    for rank in runs:
        for stage in range(4):
            run, ref = rank[stage]["run"], rank[stage]["train_step"]
            assert run["mean_losses"] == ref["losses"], f"stage {stage}"
            for name, w in run["weights"].items():
                assert torch.equal(ref["weights"][name], w), (stage, name)


@pytest.mark.skipif(not os.environ.get("FZ_DEEPSPEED_PYTHON"), reason="set FZ_DEEPSPEED_PYTHON to a python with "
                    "DeepSpeed installed to compare with a live DeepSpeed run")
def test_against_a_live_deepspeed_run(runs, tmp_path):
    out = tmp_path / "ds.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), str(RECORD.parents[1])])}
    subprocess.run([os.environ["FZ_DEEPSPEED_PYTHON"], str(RECORD.parents[1] / "support" / "ds_engine_jobs.py"),
                    str(out)], env=env, check=True, timeout=600, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    _check_against(json.loads(out.read_text()), runs)


def test_every_ranks_model_holds_rank_0s_weights_after_initialize(runs):
    """Before any update, at ZeRO 0-2 (a local copy): rank 1's model reads rank 0's initial weights."""
    for name, w in runs[0]["own_init"].items():
        assert torch.equal(runs[1]["own_init"][name], w), name


def test_a_forward_between_micro_batches_at_zero3_runs_on_the_open_updates_weights(runs):
    """An eval-mode (and a train-mode no_grad) forward inside an accumulation window at ZeRO-3:
    the last update's model's output, and the updates of the loop without it."""
    for rank in runs:
        (seen, weights), (_, plain) = rank["window"]
        for inside, after_previous in zip(seen[2::2], seen[1::2]):
            torch.testing.assert_close(inside, after_previous, rtol=0, atol=0)
        for name, w in plain.items():
            torch.testing.assert_close(weights[name], w, rtol=0, atol=0)


def test_each_rank_keeps_its_own_batchnorm_statistics(runs):
    """DeepSpeed syncs no module buffer (fz averaged them over ranks): each rank's running mean is
    an eager BatchNorm's over that rank's rows."""
    for rank in runs:
        running, eager = rank["own_buffers"]
        torch.testing.assert_close(running, eager, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(runs[0]["own_buffers"][0], runs[1]["own_buffers"][0])


@pytest.mark.parametrize("stage", [1, 3])
def test_safe_get_full_fp32_param_and_moments_are_whole_on_every_rank(runs, stage):
    """At ZeRO-3 gathered from the shards; at ZeRO-1 the parameter is whole on each rank (summing
    it over ranks doubled it); DeepSpeed 0.19.8's values at world 2."""
    a, b = (rank["fragments"][stage] for rank in runs)
    for key in ("fp32", "exp_avg", "set"):
        assert torch.equal(a[key], b[key]), key
    assert torch.equal(a["fp32"], a["full"]) and a["exp_avg"].abs().sum() > 0
    assert torch.equal(a["set"], torch.arange(4.0))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradients_read_between_backward_and_step_are_deepspeeds(runs, stage):
    """As DeepSpeed 0.19.8 shows them (checked side by side at world 2): `p.grad` holds this rank's
    own gradient before the boundary at ZeRO 0-1, the average over ranks after the boundary's
    backward at ZeRO 0 (ZeRO-1 reduces it into shards: None, and ZeRO 2-3 always), None after the
    update; safe_get_full_grad gives the average at every stage."""
    for rank in runs:
        got = rank["grads"][stage]
        torch.testing.assert_close(got["full"], got["mean"], rtol=1e-5, atol=1e-7)
        if stage <= 1:
            torch.testing.assert_close(got["shown"][0], got["own"], rtol=1e-5, atol=1e-7)
        else:
            assert got["shown"][0] is None
        if stage == 0:
            torch.testing.assert_close(got["shown"][1], got["mean"], rtol=1e-5, atol=1e-7)
        else:
            assert got["shown"][1] is None
        assert got["after"] is None
    assert not torch.allclose(runs[0]["grads"][stage]["own"], runs[1]["grads"][stage]["own"])
