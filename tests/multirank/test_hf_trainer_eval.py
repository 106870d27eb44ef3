"""fz.hf.Trainer's evaluation, best metric and random draws, against transformers' Trainer running
the same script at world 2 (tests/support/hf_eval_jobs.py has the cases).

- The evaluation loss is what transformers' prediction_step takes: `compute_loss` (a subclass's
  override too) with the batch's num_items_in_batch summed over ranks; predict() alike.
- EarlyStoppingCallback stops at the step transformers stops at; save_strategy="best" keeps the
  checkpoints transformers keeps, and the state names the best one.
- A collator's random masks and the model's dropout draw from the process's generator where
  transformers draws them (each epoch's DataLoader base seed, accelerate's one micro-batch
  read ahead, the evaluation between): BERT's masked LM with its default dropout gives
  transformers' losses step for step.

Tolerance: fp32 sums over the same tokens grouped otherwise (ZeRO-3's buckets, DDP's), 1e-5
relative, as tests/multirank/test_hf_trainer_pipeline.py.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from fz.testing.spawn import run_ranks  # noqa: E402

from support.helpers import max_rel  # noqa: E402
from support.hf_eval_jobs import CASES, both_runs  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory, load):
    out = str(tmp_path_factory.mktemp("hf_eval"))
    with load:
        return run_ranks(2, both_runs, out, timeout=600)


def close(ours, theirs) -> bool:
    return len(ours) == len(theirs) and all(
        (a == b) if not isinstance(a, float) else (math.isnan(a) and math.isnan(b)) or
        abs(a - b) <= TOL * max(abs(b), 1e-3) for x, y in zip(ours, theirs) for a, b in zip(x, y))


@pytest.mark.parametrize("case", CASES)
def test_training_and_evaluation_logs_equal_transformers(runs, case):
    for r in runs:
        ours, theirs = r[(case, True)], r[(case, False)]
        assert len(theirs["eval"]) >= 2 and len(theirs["train"]) >= 3
        assert close(ours["train"], theirs["train"]), (ours["train"], theirs["train"])
        assert close(ours["eval"], theirs["eval"]), (ours["eval"], theirs["eval"])
        assert ours["steps"] == theirs["steps"]
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=TOL)


def test_predict_takes_the_compute_loss_override(runs):
    for r in runs:
        (loss, acc, preds), (want_loss, want_acc, want) = r[("override", True)]["predict"], \
            r[("override", False)]["predict"]
        assert loss == pytest.approx(want_loss, rel=TOL) and acc == want_acc
        assert preds.shape == want.shape and max_rel(preds.ravel().tolist(), want.ravel().tolist()) < 1e-4
        assert np.isfinite(preds).all()


def test_early_stopping_and_the_best_checkpoint_are_transformers(runs):
    for r in runs:
        ours, theirs = r[("early", True)], r[("early", False)]
        assert theirs["steps"] < 3 * 36 // 4  # transformers stopped early
        assert ours["best"][0] == pytest.approx(theirs["best"][0], rel=TOL)
        assert ours["best"][1:] == theirs["best"][1:] and ours["best"][2]
    ours, theirs = runs[0][("early", True)], runs[0][("early", False)]
    assert ours["saved"] == theirs["saved"] and len(ours["saved"]) >= 1
