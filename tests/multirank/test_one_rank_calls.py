"""A collective API called on one rank only fails fast, naming it, instead of hanging.

Rank 0 calls fz.save (rank 1 goes on to its next train_step), then rank 1 calls
fz.full_params alone: the lone caller raises a ConfigError ("every rank must call ...")
within seconds although Spec.timeout_s is 30, because the missing rank is seen waiting
elsewhere; both ranks then carry on together, and a save on every rank works. A rank
that is not in fz at all is waited for up to Spec.timeout_s.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
from safetensors.torch import save_model

import fz
from fz.testing.spawn import run_ranks

from support.helpers import make_model, rank_batches, spec
from support.timing import Slowdown

TIMEOUT_S = 30.0  # Spec.timeout_s of the calls that fail fast: what a hang would take
FAST_S = 10.0  # what failing fast takes at most on a quiet machine


def _timed(fn):
    t0 = time.monotonic()
    try:
        fn()
    except fz.ConfigError as e:
        return str(e), time.monotonic() - t0
    return "", time.monotonic() - t0


def _job(rank, world, root):
    out = {}
    state = fz.init(make_model(), spec(3, 1, timeout_s=TIMEOUT_S))
    batches = rank_batches(world, 1, 6)
    state, _ = fz.train_step(state, batches[0][rank])
    if rank == 0:
        out["save"] = _timed(lambda: fz.save(state, root))
    state, loss = fz.train_step(state, batches[1][rank])  # the ranks pair up again
    if rank == 1:
        out["full_params"] = _timed(lambda: fz.full_params(state))
    state, loss = fz.train_step(state, batches[2][rank])
    out["loss"] = float(loss)
    fz.save(state, root)  # every rank: it works
    out["saved"] = fz.Checkpointer(root).latest_step()
    if rank == 0:  # reloading weights "on the main process": it hung at its NaN counts' all-reduce
        weights = os.path.join(root, "weights.safetensors")
        save_model(make_model(1), weights)
        out["load_weights"] = _timed(lambda: fz.load_weights(state, weights))
    state, _ = fz.train_step(state, batches[3][rank])
    # a rank that is not in fz at all: waited for up to Spec.timeout_s
    state = fz.init(make_model(), spec(0, 1, timeout_s=3.0))
    if rank == 0:
        out["idle"] = _timed(lambda: fz.full_params(state))
    else:
        time.sleep(6)
    # evaluating and printing samples under `if rank == 0:` (issue 29): apply works alone where
    # every parameter is local (stages 0-2); eval_step (a mean over ranks) and stage 3's apply fail fast
    x = batches[3][rank][:, :-1]
    for stage in (0, 3):
        state = fz.init(make_model(), spec(stage, 1, timeout_s=TIMEOUT_S))
        state, _ = fz.train_step(state, batches[3][rank])
        both = fz.apply(state, x)
        if rank == 0:
            alone = []
            out[stage, "apply"] = _timed(lambda: alone.append(fz.apply(state, x)))  # noqa: B023
            out[stage, "apply_same"] = bool(alone) and torch.equal(alone[0], both)
            out[stage, "eval_step"] = _timed(lambda: fz.eval_step(state, batches[4][0]))  # noqa: B023
        state, loss = fz.train_step(state, batches[4][rank])  # and they carry on together
        out[stage, "loss"] = float(loss)
    if rank == 0:  # its last call, while rank 1 finishes its script
        out["last"] = _timed(lambda: fz.apply(state, x))
        try:  # a collective with no arrival check: the PeerError says rank 1 finished, not that it was lost
            fz.train_step(state, batches[5][0])
        except fz.PeerError as e:
            out["peer"] = str(e)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    with Slowdown() as slow:
        out = run_ranks(2, _job, str(tmp_path_factory.mktemp("one_rank")), timeout=180)
    out[0]["fast"] = out[1]["fast"] = min(slow.scaled(FAST_S), TIMEOUT_S)  # scaled, but below a hang's
    out[0]["slow"] = slow
    return out


def test_save_on_one_rank_fails_fast_naming_the_missing_rank(results):
    msg, took = results[0]["save"]
    assert "fz.save: every rank must call fz.save" in msg and "rank(s) [1]" in msg, msg
    assert "fz.train_step at step 1" in msg, msg  # what rank 1 is doing
    assert took < results[0]["fast"], took  # not Spec.timeout_s=30


def test_full_params_on_one_rank_fails_fast(results):
    msg, took = results[1]["full_params"]
    assert "fz.full_params: every rank must call fz.full_params" in msg and "rank(s) [0]" in msg, msg
    assert took < results[0]["fast"], took


def test_load_weights_on_one_rank_fails_fast(results):
    msg, took = results[0]["load_weights"]
    assert "fz.load_weights: every rank must call fz.load_weights" in msg and "rank(s) [1]" in msg, msg
    assert took < results[0]["fast"], took


def test_the_ranks_carry_on_together_after_it(results):
    assert results[0]["loss"] == results[1]["loss"] and torch.isfinite(torch.tensor(results[0]["loss"]))
    assert results[0]["saved"] == results[1]["saved"] == 3


def test_a_rank_outside_fz_is_waited_for_up_to_the_timeout(results):
    msg, took = results[0]["idle"]
    assert "did not call it within Spec.timeout_s=3 s" in msg, msg
    assert 3 <= took < 3 + results[0]["slow"].scaled(3), took


def test_apply_on_one_rank_works_where_every_parameter_is_local(results):
    msg, took = results[0][0, "apply"]
    assert msg == "" and results[0][0, "apply_same"], msg  # stage 0: rank 0's own output, at once
    assert took < results[0]["fast"], took


def test_eval_step_and_stage3_apply_on_one_rank_fail_fast_with_the_fix(results):
    for key in ((0, "eval_step"), (3, "eval_step"), (3, "apply")):
        api = "fz." + key[1]
        msg, took = results[0][key]
        assert f"{api}: every rank must call {api} (it is collective), but rank(s) [1] are waiting" in msg, msg
        assert "to print on one rank, call it on every rank and print under the `if`" in msg, msg
        assert took < results[0]["fast"], (key, took)
    for stage in (0, 3):
        assert results[0][stage, "loss"] == results[1][stage, "loss"], stage


def test_a_rank_that_finished_its_script_is_not_called_lost(results):
    msg, took = results[0]["last"]
    assert "rank(s) [1] finished their script without calling it" in msg and "lost" not in msg, msg
    assert took < results[0]["fast"], took
    peer = results[0]["peer"]
    assert "fz.train_step at step 2: a collective failed: rank(s) [1] finished its script" in peer, peer
    assert "lost" not in peer, peer
