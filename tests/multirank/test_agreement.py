"""Ranks that drift apart are an error on every rank, naming them: steps (carried on the loss
all-reduce), batch sizes (or weighted by rows), client_state at save, replicated values at init.

One world-2 spawn runs every scenario; the tests assert on what the ranks returned.
"""
from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn as nn

import fz
import fz.step.phases as train_module  # where the step gathers its metrics
from fz.testing.gpt import lm_loss, synthetic_tokens
from fz.testing.spawn import run_ranks

from support.helpers import CFG, CLIP, config_error, make_model, max_rel, params_rel, rank_batches, spec

WEIGHTED_ROWS = (3, 1)  # rank 0 and rank 1 rows per step with weight_by_rows=True
STEPS = 3


_error = config_error


def _weighted_batches():
    """batches[step] = the global batch; rank r gets its WEIGHTED_ROWS[r] rows of it."""
    return [synthetic_tokens(sum(WEIGHTED_ROWS), CFG.seq, CFG.vocab, seed=500 + s) for s in range(STEPS)]


def _carry_on_after_a_failure(rank: int, world: int, stage: int):
    """Rank 1's second step fails after its collectives (it caught the exception and carried on
    with the state it had): its third step pairs with rank 0's third, one step behind."""
    state = fz.init(make_model(), spec(stage, 1))
    batches = rank_batches(world, 1, 3)
    state, _ = fz.train_step(state, batches[0][rank])
    real = train_module.step_metrics
    if rank == 1:
        def boom(*args, **kwargs):
            raise RuntimeError("a bug after the update")
        train_module.step_metrics = boom
    try:
        state, _ = fz.train_step(state, batches[1][rank], donate=False)
    except RuntimeError:
        pass  # ... and carries on
    finally:
        train_module.step_metrics = real
    msg = _error(lambda: fz.train_step(state, batches[2][rank]))
    return msg, _error(lambda: fz.train_step(state, batches[2][rank]))  # its buffers took that update


class Noisy(nn.Module):
    """A meta-init module whose reset_parameters draws from an unseeded source."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4))

    def reset_parameters(self):
        self.w.fill_(random.Random(os.getpid()).random())

    def forward(self, x):
        return (x * self.w).sum()


def _scenarios(rank: int, world: int, root: str) -> dict:
    out = {"steps": {stage: _carry_on_after_a_failure(rank, world, stage) for stage in (0, 3)}}

    state = fz.init(make_model(), spec(0, 1))
    batch = rank_batches(world, 1, 1)[0][rank]
    out["fewer_rows"] = _error(lambda: fz.train_step(state, batch[:1] if rank == 1 else batch, donate=False))
    out["shorter_rows"] = _error(lambda: fz.train_step(state, batch[:, :-4] if rank == 1 else batch, donate=False))
    out["eval_rows"] = _error(lambda: fz.eval_step(state, batch[:1] if rank == 1 else batch))

    state = fz.init(make_model(), spec(3, 1, weight_by_rows=True))
    losses = []
    for tokens in _weighted_batches():
        state, loss = fz.train_step(state, tokens.split(WEIGHTED_ROWS)[rank])
        losses.append(float(loss))
    out["weighted"] = (losses, fz.full_params(state))

    client = {"epoch": 3, "seen": [rank, 7], "t": torch.full((2,), rank), "same": torch.ones(2)}
    out["client_shared"] = _error(lambda: fz.save(state, f"{root}/shared", client_state=client))
    out["client_shared_dir"] = sorted(os.listdir(f"{root}/shared")) if os.path.isdir(f"{root}/shared") else []
    fz.save(state, f"{root}/per_rank", client_state=client, client_state_per_rank=True)
    _, got = fz.restore(fz.init(make_model(), spec(3, 1)), f"{root}/per_rank", with_client_state=True)
    out["client_per_rank"] = got

    with torch.device("meta"):
        noisy = Noisy()
    out["replicated"] = _error(lambda: fz.init(noisy, fz.Spec(stage=0)))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(2, _scenarios, str(tmp_path_factory.mktemp("agree")), timeout=300)


def test_ranks_at_different_steps_raise_on_every_rank_naming_them(results):
    for rank, res in enumerate(results):
        for stage, (msg, again) in res["steps"].items():
            assert "different steps" in msg, (rank, stage, msg)
            assert "rank 1: step 1" in msg and "rank 0: step 2" in msg, (rank, stage, msg)
            if stage == 0:  # the update ran (overlapped with the check) in place: no silent reuse of that state
                assert "donated" in again, again
            else:  # stages 1-3 check before the update (fz/step/nonfinite.py): that state is untouched
                assert "different steps" in again, again


def test_unequal_rows_raise_naming_the_ranks_and_rows_but_other_lengths_train(results):
    for res in results:
        assert "differ in rows" in res["fewer_rows"], res["fewer_rows"]
        assert "rank 0: rows 2" in res["fewer_rows"] and "rank 1: rows 1" in res["fewer_rows"], res["fewer_rows"]
        assert "weight_by_rows=True" in res["fewer_rows"]
        assert res["shorter_rows"] == "", res["shorter_rows"]  # sequences of another length train, as under DDP
        assert "fz.eval_step" in res["eval_rows"] and "rank 1: rows 1" in res["eval_rows"]


def test_weight_by_rows_follows_the_reference_on_the_whole_batch(results):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    want = []
    for tokens in _weighted_batches():
        loss = lm_loss(model, tokens)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        want.append(loss.item())
    ref = {k: v.detach() for k, v in model.named_parameters()}
    for res in results:
        losses, params = res["weighted"]
        assert max_rel(losses, want) < 1e-5, (losses, want)
        assert params_rel(params, ref) < 1e-5


def test_client_state_must_agree_or_be_saved_per_rank(results):
    for rank, res in enumerate(results):
        msg = res["client_shared"]
        assert "client_state differs between ranks in 'seen' (rank 1 vs rank 0); 't' (rank 1 vs rank 0)" in msg, msg
        assert "'epoch'" not in msg and "'same'" not in msg and "client_state_per_rank=True" in msg
        if rank == 0:  # rank 0 removed what it had prepared
            assert not any(n.startswith("step_") for n in res["client_shared_dir"]), res["client_shared_dir"]
        got = res["client_per_rank"]
        assert got["epoch"] == 3 and got["seen"] == [rank, 7], got
        assert torch.equal(got["t"], torch.full((2,), rank)) and torch.equal(got["same"], torch.ones(2))


def test_replicated_values_that_differ_between_ranks_fail_init(results):
    for res in results:
        msg = res["replicated"]
        assert "parameter 'w': rank(s) [1] differ from rank 0" in msg, msg
