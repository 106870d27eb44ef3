"""TRL's online trainers (GRPO, RLOO, Distillation) on fz with one line, `fz.hf.on_fz(trl.GRPOTrainer)`, against TRL
itself at world 2 in the same processes (tests/support/trl_online_jobs.py).

Their `_prepare_inputs` generates completions with the policy, scores them and slices them into
micro-steps; fz's loop reads the sampler's generation batches, copies the State's weights into
the policy before TRL's code generates with it, and trains the prepared micro-batches with
ZeRO-3 (a DeepSpeed dict). Sampling draws from each process's generator, so the logged rewards
and completion lengths agree with TRL's only if the data order, the weights each generation sees
and every draw before it agree: they are equal, and the losses, norms and KL agree to fp32
rounding; so do GRPO's evaluations (generating too) and a streamed dataset's. On-policy
distillation runs its loss through TRL's forward redirection, the teacher an inference-only
State: its losses and evaluations are TRL's. A GRPO run resumed from its step-2 checkpoint logs
the uninterrupted run's steps 3-4.
"""
from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")

from fz.testing.spawn import run_ranks  # noqa: E402

from support.helpers import max_rel, params_rel  # noqa: E402
from support.trl_online_jobs import KINDS, jobs  # noqa: E402

TOL = 1e-5
EXACT = ("reward", "reward_std", "completions/mean_length", "completions/clipped_ratio", "num_tokens", "epoch")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(2, jobs, str(tmp_path_factory.mktemp("trl_online")), timeout=600)


@pytest.mark.parametrize("kind", list(KINDS))
def test_logs_equal_trls_own_run(runs, kind):
    for r in runs:
        got, want = r[kind], r[f"trl-{kind}"]
        assert got["steps"] == want["steps"] == len(want["logs"]) == 4
        assert [sorted(log) for log in got["logs"]] == [sorted(log) for log in want["logs"]]
        for key in {k for log in want["logs"] for k in log}:  # rewards and lengths: logged where it generated
            ours = [log[key] for log in got["logs"] if key in log]
            theirs = [log[key] for log in want["logs"] if key in log]
            if key in EXACT:
                assert ours == theirs, (kind, key, ours, theirs)
            else:
                assert max_rel(ours, theirs) < TOL or max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-6, \
                    (kind, key, ours, theirs)
        key = "completions/mean_length" if kind.startswith("distill") else "reward"
        assert len({log[key] for log in want["logs"] if key in log}) > 1  # what it generates changes
        if KINDS[kind].get("beta"):
            assert any(log["kl"] > 0 for log in want["logs"])


@pytest.mark.parametrize("kind", ["grpo_stream", "distill", "distill_peft"])
def test_evaluations_equal_trls_own(runs, kind):
    """GRPO's and distillation's evaluations generate too: every 2 steps, with the weights of that
    step (distillation's loss with the teacher's)."""
    exact = "eval_reward" if kind == "grpo_stream" else "eval_completions/mean_length"
    for r in runs:
        got, want = r[kind]["evals"], r[f"trl-{kind}"]["evals"]
        assert len(want) == 2 and [sorted(e) for e in got] == [sorted(e) for e in want]
        assert kind == "grpo_stream" or all(e["eval_loss"] > 0 for e in want)  # the teacher differs
        for ours, theirs in zip(got, want):
            assert ours[exact] == theirs[exact], (ours, theirs)
            assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=TOL, abs=1e-6), (ours, theirs)


@pytest.mark.parametrize("kind", list(KINDS))
def test_trained_weights_equal_trls(runs, kind):
    """To fp32 rounding (the ranks' sums grouped otherwise, after 4 Adam updates at lr 3e-2)."""
    for r in runs:
        assert params_rel(r[kind]["weights"], r[f"trl-{kind}"]["weights"]) < 1e-5


def test_a_resumed_run_logs_the_uninterrupted_ones_last_steps(runs):
    for r in runs:
        whole, resumed = r["resume"]["whole"], r["resume"]["resumed"]
        assert len(whole) == len(resumed) == 4  # steps 1-2 from the checkpoint's trainer_state.json
        assert resumed == whole
