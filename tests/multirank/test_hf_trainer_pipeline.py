"""fz.hf.Trainer on the standard Hugging Face data pipeline (issue 39), against transformers'
own Trainer running the same script.

A tiny Llama, a tokenizer, texts of 3-19 words and transformers' collators, unchanged
(DataCollatorForLanguageModeling, DataCollatorForSeq2Seq, and DataCollatorWithPadding, the
Trainer's default with processing_class=tokenizer, on sequence classification): each rank's
micro-batches are padded to their own longest row, so lengths differ per rank, micro-batch
and step. fz.hf.Trainer at world 2 (ZeRO 0, 2, 3 from a DeepSpeed dict with "auto" values)
against transformers.Trainer at world 1 with the same global batch (4 rows x accumulation),
one epoch of 44 samples, whose last step is smaller (12 samples where the others have 16).
Sequence classification, and a causal LM that takes no `num_items_in_batch` (transformers
then averages each micro-batch), are compared with transformers' Trainer at world 2 (DDP)
instead: transformers' own loss for them changes with the world size (support/hf_pipeline.py).

Tolerance: the losses are sums over the same tokens grouped otherwise (two ranks' partial
sums, micro-batches of 2 rows instead of 4, padded to other lengths), so they agree to fp32
rounding, 1e-5 relative; the weights after up to 11 AdamW steps to 1e-4 (AdamW divides by the
root of the second moment, which magnifies rounding in the smallest gradients).
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from fz.testing.spawn import run_ranks  # noqa: E402

from support.helpers import max_rel, params_rel  # noqa: E402
from support.hf_pipeline import RUNS, at_world_2, fz_runs, reference_key, reference_runs  # noqa: E402

LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory, load):
    out = str(tmp_path_factory.mktemp("hf_pipeline"))
    with load:
        return run_ranks(2, fz_runs, out, timeout=600), run_ranks(1, reference_runs, out, timeout=600)[0]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_losses_and_weights_equal_transformers_trainer(runs, name):
    fz2, ref = runs
    for r in fz2:
        want = r[reference_key(name)] if at_world_2(name) else ref[reference_key(name)]
        assert len(want["losses"]) == want["steps"] > 1
        got = r[name]
        assert got["steps"] == want["steps"]  # the epoch's last, smaller step is trained
        assert max_rel(got["losses"], want["losses"]) < LOSS_TOL, (got["losses"], want["losses"])
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=LOSS_TOL)
        assert got["epochs"] == pytest.approx(want["epochs"], abs=1e-12)
        assert got["lrs"] == pytest.approx(want["lrs"], rel=1e-9)
        assert params_rel(got["weights"], want["weights"]) < WEIGHT_TOL
        assert got["problem_type"] == want["problem_type"]  # what the forward writes into the config (classes)


def test_gather_for_metrics_drops_the_samples_the_last_step_fills_in(runs):
    """accelerate truncates gather_for_metrics to the epoch's remainder through its last step (TRL's
    num_tokens, mean_token_accuracy, DPO's logits/*): fz's loader told it nothing, so the filled-in
    micro-batches were counted (num_tokens stayed off for the rest of the run)."""
    fz2, _ = runs
    for r in fz2:
        got, want = r["mean_odd_z2"]["gathered"], r[reference_key("mean_odd_z2")]["gathered"]
        assert got == want and len(set(got)) > 1  # as transformers' Trainer at world 2; the last step's differ


def test_total_flos_and_tokens_seen_are_counted_over_both_ranks(runs):
    fz2, ref = runs
    for r in fz2:
        assert r["lm_z0"]["total_flos"] > 0
        # every sample's tokens once, on both ranks together (non_padding: the attention mask)
        assert r["lm_z0"]["tokens_seen"] == ref["lm_ga2_sequential"]["tokens_seen"] > 0
    assert fz2[0]["lm_z0"]["total_flos"] == fz2[1]["lm_z0"]["total_flos"]


def test_save_model_or_evaluate_on_one_rank_fails_fast_naming_the_call_and_the_fix(runs, load):
    fz2, _ = runs
    said, seconds = fz2[0]["one_rank"]["save_model"]
    assert "trainer.save_model()" in said and "trainer.is_world_process_zero()" in said, said
    fast = min(load.scaled(150), 300)  # before Spec.timeout_s (300 s): the missing rank was seen elsewhere
    assert seconds < fast, (seconds, load)
    said, seconds = fz2[1]["one_rank"]["evaluate"]
    assert "trainer.evaluate()" in said and seconds < fast, (said, seconds, load)
    said, seconds = fz2[0]["one_rank"]["model_call"]  # a callback's sample under `if rank == 0:` at ZeRO-3
    assert "trainer.model called while train() runs" in said and "make it on every rank" in said, said
    assert seconds < fast, (said, seconds, load)


def test_resume_from_a_folder_that_is_not_a_checkpoint_lists_the_checkpoints(runs):
    for r in runs[0]:
        said = r["one_rank"]["resume"]
        assert "does not exist" in said and "checkpoint-1, checkpoint-2" in said, said
