"""fz.generate (issue 24) at world 1 and 2: greedy output equals HF's own generate on the whole
model token for token (tiny Llama and GPT-2, stages 0 and 3, each residency plan forced, left-padded
prompts of different lengths, a different count of new tokens per rank, an eos); "gather" gathers
each bucket once per call, "stream" once per forward, and a rank that finished first keeps pace;
sampling with a seed is the same on every rank and equals HF's; generating between train steps
changes nothing; a call on one rank only fails fast at stage 3 and is local at stage 0; fz.evaluate
gathers once for many batches; bad arguments are clear ConfigErrors."""
from __future__ import annotations

import pytest
import torch

import fz

from support.generate_jobs import PLANS, all_checks, prompts, tiny
from support.ranks import cached_runs

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def runs(request, load):
    with load:
        return request.param, cached_runs(request.param, all_checks, timeout=400)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_greedy_equals_hf_generate_for_every_stage_and_plan(runs, name):
    _, res = runs
    for rank, r in enumerate(res):
        for stage in (0, 3):
            for plan in PLANS:
                assert r["greedy"][name, stage, plan][0], (rank, stage, plan)
            assert r["greedy"][name, stage, "eos"], (rank, stage)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_gather_once_gathers_each_bucket_once_and_stream_per_forward_in_lockstep(runs, name):
    world, res = runs
    forwards = max(r["greedy"]["forwards"] for r in res)  # a rank that finished first runs as many
    for r in res:
        g = r["greedy"]
        n = g[name, 3, "buckets"]
        assert n > 1 and g[name, 0, "gather"][1] == g[name, 0, "stream"][1] == 0  # stages 0-2 gather nothing
        assert g[name, 3, "gather"][1] == g[name, 3, "auto"][1] == n
        assert g[name, 3, "stream"][1] == n * forwards
        assert g[name, 3, 1][1] == 1 + (n - 1) * forwards  # the root kept, the blocks streamed


def test_sampling_with_a_seed_is_repeatable_equal_on_every_rank_and_equal_to_hf(runs):
    _, res = runs
    for r in res:
        s = r["sampling"]
        assert torch.equal(s["first"], s["again"]) and torch.equal(s["first"], res[0]["sampling"]["first"])
        assert s["hf"] and s["rng_kept"]


def test_generate_between_train_steps_changes_nothing(runs):
    _, res = runs
    for r in res:
        for stage in (0, 3):
            same_losses, same_params, losses = r["mid_training"][stage]
            assert same_losses and same_params, (stage, losses)


def test_generate_on_one_rank_fails_fast_at_stage_3_and_is_local_at_stage_0(runs, load):
    world, res = runs
    if world == 1:
        pytest.skip("needs two ranks")
    msg, took, _ = res[0]["one_rank"][3]
    assert "every rank must call fz.generate (it is collective)" in msg and took < load.scaled(15), (msg, took, load)
    msg, _, got = res[0]["one_rank"][0]
    assert msg == "" and got is not None and got.shape[1] == 8
    assert res[0]["one_rank"][0, "loss"] == res[1]["one_rank"][0, "loss"]  # and they went on together


def test_evaluate_gathers_once_for_many_batches_and_equals_eval_step(runs):
    _, res = runs
    for r in res:
        e = r["evaluation"]
        n = e["buckets"]
        assert all(e["gather"][0]) and all(e["stream"][0]) and all(e["auto"][0])
        assert e["gather"][1] == e["auto"][1] == n and e["stream"][1] == 3 * n
        assert e["eval_step"] and e["apply"]


def test_bad_arguments_are_clear_config_errors():
    state = fz.init(tiny("llama"), fz.Spec(stage=3))
    ids, mask = prompts(0)
    with pytest.raises(fz.ConfigError, match=r"residency='all': give 'auto' \(chosen from the memory budget\)"):
        fz.generate(state, ids, mask, residency="all", max_new_tokens=2)
    with pytest.raises(fz.ConfigError, match="do not pass synced_gpus: fz keeps the ranks of a stage-3 state"):
        fz.generate(state, ids, mask, synced_gpus=True, max_new_tokens=2)
    with pytest.raises(fz.ConfigError, match=r"residency=-1: give 'auto'"):
        fz.evaluate(state, [{"input_ids": ids, "labels": ids}], residency=-1)
    from fz.testing.gpt import GPT, GPTConfig
    gpt = fz.init(GPT(GPTConfig()), fz.Spec(stage=0))
    with pytest.raises(fz.ConfigError, match="needs a model with Hugging Face's generate\\(\\) .*GPT has none"):
        fz.generate(gpt, ids)
