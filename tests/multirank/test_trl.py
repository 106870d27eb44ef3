"""TRL's trainers on fz with one line, `fz.hf.on_fz(trl.SFTTrainer)` (issue 41), against TRL itself.

Each TRL trainer runs as a TRL user writes it (its own config class with `deepspeed=`, its
collators and loss), on fz at world 2 with ZeRO-3 from a DeepSpeed dict, and on plain TRL at
world 1 with the same global batch (4 rows, 2 accumulation steps): SFT on text, packed, and
prompt-completion (completion-only loss); DPO with a reference model (on fz an inference-only
State sharded as the policy is) and with a LoRA policy and no reference (the adapter disabled);
Reward; KTO with a reference model. Logged losses and TRL's metrics agree to fp32 rounding (1e-5 relative: sums grouped
otherwise over two ranks); so do the evaluations every 2 steps, against TRL at world 2 (DDP).
A resumed SFT run is the uninterrupted one bit for bit; save_model writes the files TRL's writes.
"""
from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")

from fz.testing.spawn import run_ranks  # noqa: E402

from support.helpers import max_rel  # noqa: E402
from support.trl_jobs import EVAL_KINDS, KINDS, fz_runs, reference_runs  # noqa: E402

TOL = 1e-5
METRICS = ("loss", "grad_norm", "learning_rate", "epoch", "mean_token_accuracy", "entropy", "accuracy", "margin",
           "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "num_tokens",
           "kl")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("trl"))
    return run_ranks(2, fz_runs, out, timeout=600), run_ranks(1, reference_runs, out, timeout=600)[0]


def same_logs(got, want, kind, keys=METRICS):
    for key in keys:
        ours = [log.get(key) for log in got]
        theirs = [log.get(key) for log in want]
        assert (ours[0] is None) == (theirs[0] is None), key
        if theirs[0] is not None:
            assert max_rel(ours, theirs) < TOL or max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-6, \
                (kind, key, ours, theirs)


@pytest.mark.parametrize("kind", KINDS)
def test_trainer_logs_equal_trls_own_run(runs, kind):
    fz2, ref = runs
    want = ref[kind]
    assert want["steps"] == len(want["logs"]) > 1
    for r in fz2:
        got = r[kind]
        assert got["steps"] == want["steps"]
        # KTO's KL term pairs each completion with another prompt of the same rank's batch: it
        # depends on the world size, and is compared with TRL's at world 2 below
        same_logs(got["logs"], want["logs"], kind, [k for k in METRICS if not (kind == "kto" and k == "kl")])


def test_kto_logs_equal_trls_own_run_at_the_same_world_size(runs):
    """KTO's KL term, gathered over the ranks (accelerate's gather_for_metrics), as TRL's at world 2 (DDP)."""
    for r in runs[0]:
        got, want = r["kto"]["logs"], r["ddp-kto"]["logs"]
        assert len(want) > 1 and any(log["kl"] > 0 for log in want)
        same_logs(got, want, "kto")


@pytest.mark.parametrize("kind", EVAL_KINDS)
def test_evaluation_logs_equal_trls_own_run(runs, kind):
    """Every 2 steps, against TRL at world 2 (DDP) in the same processes: TRL's loss (its compute_loss,
    DPO's prediction_step) and its metrics under their `eval_` names (TRL tells evaluation from
    training by `trainer.model.training`)."""
    for r in runs[0]:
        got, want = r[kind]["evals"], r[f"ddp-{kind}"]["evals"]
        assert len(want) >= 2 and "eval_loss" in want[0]
        assert [sorted(e) for e in got] == [sorted(e) for e in want], (got, want)
        for ours, theirs in zip(got, want):
            for key, value in theirs.items():
                assert ours[key] == pytest.approx(value, rel=TOL, abs=1e-6), (kind, key, ours[key], value)


def test_reference_model_is_an_inference_only_state_sharded_as_the_policy(runs):
    for r in runs[0]:
        ref = r["ref"]
        assert ref["class"] == "OnFzModel" and ref["stage"] == 3
        assert ref["params"] == ref["numel"] * 4 // 2  # its half of the fp32 parameters, on each of 2 ranks
        assert ref["grads"] == 0 and ref["optimizer"] == 0


def test_a_resumed_run_is_the_uninterrupted_one_bit_for_bit(runs):
    for r in runs[0]:
        first, resumed = r["resume"]["first"], r["resume"]["resumed"]
        assert len(first) == 5 and resumed[-3:] == first[-3:]
        assert r["resume"]["same_weights"]


def test_save_model_writes_the_files_trls_writes(runs):
    fz2, ref = runs
    assert fz2[0]["saved"] == ref["saved"]
    assert {"config.json", "model.safetensors", "training_args.bin", "tokenizer.json"} <= set(ref["saved"])
