"""fz.hf.Trainer (issue 23): a Trainer script written for DeepSpeed trains on fz with one import
changed, and matches transformers' own Trainer.

One world-2 run trains a tiny GPT-2 at ZeRO-3 from a DeepSpeed dict (DeepSpeed is not
installed), saving checkpoint-3 and evaluating every 3 steps, then resumes from checkpoint-3
in a new Trainer; one world-1 run makes transformers' reference (same global batch: 4 rows x
2 accumulation steps) and resumes the world-2 checkpoint at world 1.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from fz.testing.spawn import run_ranks  # noqa: E402

from support.hf_trainer_jobs import reference_and_resume, train_save_resume  # noqa: E402


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf_trainer") / "out")


@pytest.fixture(scope="module")
def runs(out):
    fz2 = run_ranks(2, train_save_resume, out, timeout=300)
    ref = run_ranks(1, reference_and_resume, out, timeout=300)[0]
    return fz2, ref


def test_losses_equal_transformers_trainer(runs):
    fz2, ref = runs
    assert len(ref["losses"]) == 6
    for r in fz2:
        assert r["world"][0] == 2
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)
        assert r["train_loss"] == pytest.approx(sum(ref["losses"]) / 6, rel=1e-5)


def test_evaluate_equals_a_single_process_evaluation(runs):
    fz2, ref = runs
    for r in fz2:
        assert r["metrics"]["eval_loss"] == pytest.approx(ref["metrics"]["eval_loss"], rel=1e-5)
        assert r["metrics"]["eval_accuracy"] == pytest.approx(ref["metrics"]["eval_accuracy"], abs=1e-9)
        assert r["pred_shape"] == (8, 16, 100) and "test_loss" in r["pred_metrics"]


def test_evaluate_without_training_and_without_a_train_dataset(runs):
    ref, ours = runs[1]["eval_only"]
    assert ours == pytest.approx(ref, rel=1e-6)


def test_logs_reach_callbacks_with_loss_lr_grad_norm_epoch(runs):
    fz2, ref = runs
    steps = [log for log in fz2[0]["logs"] if "loss" in log]
    assert len(steps) == 6
    assert all({"loss", "learning_rate", "grad_norm", "epoch"} <= set(log) for log in steps)
    assert [s["learning_rate"] for s in steps] == pytest.approx(ref["lrs"], abs=1e-12)  # warmup 2, then linear
    assert [s["epoch"] for s in steps] == pytest.approx([i / 8 for i in range(1, 7)])
    assert sum("eval_loss" in log for log in fz2[0]["logs"]) == 3  # steps 3 and 6, and evaluate()


def test_checkpoint_folders_and_resume_bit_identical(runs):
    fz2, ref = runs
    r0 = fz2[0]
    assert {"checkpoint-3", "checkpoint-6"} <= set(r0["listing"])
    assert {"fz", "trainer_state.json", "config.json", "generation_config.json"} <= set(r0["ckpt3"])  # as transformers'
    assert r0["state_json_step"] == 3
    for r in fz2:  # world 2 -> 2: the resumed steps 4-6 are the uninterrupted run's, bit for bit
        assert r["resumed"][-3:] == r["losses"][-3:]
        assert len(r["resumed"]) == 6  # the checkpoint's log history, then the new steps
    assert ref["resumed"][-3:] == pytest.approx(r0["losses"][-3:], rel=1e-6)  # world 2 -> 1


def test_model_holds_the_trained_weights_after_train(runs):
    assert all(r["model_matches_state"] for r in runs[0])


def test_save_total_limit_rotates_and_resume_true_takes_the_last(runs):
    _, ref = runs
    assert [k for k in ref["kept"] if k.startswith("checkpoint-")] == ["checkpoint-4", "checkpoint-6"]
    assert ref["resumed_steps"] == [1, 2, 3, 4, 5, 6, 7, 8]  # 1-6 from checkpoint-6's history, then 7 and 8
    assert ref["tensorboard_files"] >= 1  # report_to="tensorboard": transformers' own callback wrote scalars


def test_seed_002_snippet_adafactor_checkpointing_accumulation(runs):
    """Seed 002's arguments (adafactor, gradient_checkpointing, accumulation, a DeepSpeed file) at
    world 2 against transformers' Trainer at world 1 with the same global batch."""
    fz2, ref = runs
    assert len(ref["seed_002"]) == 6
    for r in fz2:
        assert r["seed_002"] == pytest.approx(ref["seed_002"], rel=1e-5, abs=1e-6)


def test_save_model_and_consolidate_hf_of_a_checkpoint_load_alike(runs, out, tmp_path):
    """trainer.save_model (from the live state) and `fz consolidate checkpoint-6/fz DIR --hf` (from the
    checkpoint, offline, in shards) give folders from_pretrained loads with identical logits."""
    import json
    import subprocess
    import sys

    import torch
    from transformers import GPT2LMHeadModel
    hf_dir = tmp_path / "hf"
    done = subprocess.run([sys.executable, "-m", "fz", "consolidate", f"{out}/checkpoint-6/fz", str(hf_dir), "--hf",
                           "--max-shard-size", "40KB"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and all((hf_dir / f).exists() for f in files)
    assert (hf_dir / "config.json").exists() and not list(hf_dir.glob(".fz-consolidate-*"))
    ids = torch.arange(32).view(2, 16) % 100
    with torch.no_grad():
        a = GPT2LMHeadModel.from_pretrained(f"{out}/final").eval()(input_ids=ids).logits
        b = GPT2LMHeadModel.from_pretrained(hf_dir).eval()(input_ids=ids).logits
    assert torch.equal(a, b)


def test_a_callback_reading_the_model_reads_each_update_at_zero_2(runs):
    """TRL's BEMACallback averages the weights it reads from trainer.model after each update: at
    ZeRO-2 (world 2, each update's parameters gathered after it) those are the State's own, as
    DeepSpeed's module holds them; its average equals the one over transformers' own run."""
    fz2, ref = runs
    if ref["bema"] is None:
        pytest.skip("TRL is not installed")
    for r in fz2:
        assert r["bema"].keys() == ref["bema"].keys()
        for k, v in ref["bema"].items():
            torch.testing.assert_close(r["bema"][k], v, rtol=1e-5, atol=1e-6)


def test_generate_in_a_callback_at_zero_3_runs_on_every_rank_as_under_deepspeed(runs):
    """trainer.model.generate while training at ZeRO-3 gathers on every rank, so transformers'
    synced_gpus is on (as under DeepSpeed ZeRO-3): a rank whose sequence ends first keeps stepping."""
    fz2, _ = runs
    for rank, r in enumerate(fz2):
        sampled, whole = r["sampled"]
        assert len(sampled[0]) == 4 + 2 + 3 * rank and sampled == whole, (rank, sampled, whole)
