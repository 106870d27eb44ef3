"""The disk tier's update streaming on after the step returns (fz/step/pending.py): the same
trajectory bit for bit as the update that waits, a skipped step that never starts writing, and
every read of the state waiting for the files it reads.

At stage 3 with parameters and optimizer on disk the update streams on in the background; at
stage 2 (optimizer on disk, parameters in memory, all-gathered after the update) it cannot and
must not: both are compared with `pipeline=False`, world 2, fp32 and bf16, with a step whose
gradients are non-finite on one rank (skipped everywhere).
"""
from __future__ import annotations

import math
import os
import threading

import pytest
import torch

import fz
from fz.step import pending, stream
from fz.storage import io as offload_io
from fz.storage.disk import load
from fz.testing.gpt import lm_loss
from fz.testing.spawn import run_ranks

from support.helpers import make_model, rank_batches, spec

STEPS, SKIP = 5, 2
HOLD_S = 60.0  # how long the update thread waits for the test to look (only a step that waited reaches it)
ARMED: list[float] = []
CASES = [(stage, precision) for stage in (2, 3) for precision in ("fp32", "bf16")]


def _loss(model, batch):
    loss = lm_loss(model, batch)
    return loss * ARMED[0] if ARMED else loss


def _values(state):
    out = {k: v.clone() for k, v in fz.full_params(state).items()}
    for k, v in (state.master or {}).items():
        out["master/" + k] = load(v._local_tensor).clone()
    return out


def _trajectory(rank, root, stage, precision, pipe):
    path = os.path.join(root, f"{stage}{precision}{pipe}r{rank}")
    os.makedirs(path)
    policy = fz.offload.nvme(path, params=stage == 3, buffer_mb=0.05, buffers=3, prefetch=2, pipeline=pipe)
    state = fz.init(make_model(), spec(stage, 1, precision=precision, loss_fn=_loss, offload=policy))
    writes, real = [0], offload_io.IOPool.write

    def counted(self, *a, **k):
        writes[0] += 1
        return real(self, *a, **k)

    # the update thread starts its work only once the step has returned and been looked at, so
    # that a step that returns without waiting for it is seen streaming however fast the disk is
    # (a step that waited instead would hold for HOLD_S, then be seen not streaming: the failure)
    releases, real_start = [threading.Event()], stream.start_inflight

    def held_start(gate, run, after):
        released = releases[-1]  # this step's: a later step's clear cannot hold it again

        def held():
            released.wait(HOLD_S)
            run()
        real_start(gate, held, after)

    offload_io.IOPool.write = counted
    stream.start_inflight = held_start
    losses, streaming, skip_writes = [], [], None
    try:
        for i, b in enumerate(rank_batches(2, 1, STEPS)):
            if i == SKIP:
                pending.join_inflight()  # the last step's writes are done: count this step's own
                before = writes[0]
                if rank == 1:
                    ARMED.append(float("inf"))
            releases.append(threading.Event())
            state, loss = fz.train_step(state, b[rank])
            ARMED.clear()
            streaming.append(pending.inflight())
            releases[-1].set()
            if i == SKIP:
                skip_writes = writes[0] - before
            losses.append(repr(float(loss)))
        values = _values(state)  # reads the files: waits for the update still streaming
        report = fz.memory_report(state).total
    finally:
        offload_io.IOPool.write = real
        stream.start_inflight = real_start
        for released in releases:
            released.set()
    return dict(losses=losses, values=values, streaming=streaming, skip_writes=skip_writes, report=report)


def _all(rank, world, root):
    return {(stage, precision, pipe): _trajectory(rank, root, stage, precision, pipe)
            for stage, precision in CASES for pipe in (False, True)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(2, _all, str(tmp_path_factory.mktemp("pipeline")), timeout=300)


@pytest.mark.parametrize("case", CASES, ids=[f"stage{s}-{p}" for s, p in CASES])
def test_the_streamed_update_is_bit_identical_to_the_waiting_one(runs, case):
    for rank in range(2):
        waits, streams = runs[rank][(*case, False)], runs[rank][(*case, True)]
        assert streams["losses"] == waits["losses"], (case, rank)
        assert not math.isfinite(float(streams["losses"][SKIP]))  # the armed step was non-finite, and skipped
        assert waits["values"].keys() == streams["values"].keys()
        for k, v in waits["values"].items():
            assert torch.equal(v, streams["values"][k]), (case, rank, k)
        assert streams["report"] == waits["report"]


@pytest.mark.parametrize("case", CASES, ids=[f"stage{s}-{p}" for s, p in CASES])
def test_only_stage_3_with_parameters_on_disk_streams_on(runs, case):
    stage = case[0]
    for rank in range(2):
        waits, streams = runs[rank][(*case, False)], runs[rank][(*case, True)]
        assert not any(waits["streaming"])
        if stage == 3:  # every update step returns with its update still streaming
            assert all(s for i, s in enumerate(streams["streaming"]) if i != SKIP), streams["streaming"]
        else:  # stage 2's parameters are all-gathered after the update: it must be done
            assert not any(streams["streaming"])


@pytest.mark.parametrize("case", CASES, ids=[f"stage{s}-{p}" for s, p in CASES])
def test_a_skipped_step_never_starts_writing(runs, case):
    for rank in range(2):
        for pipe in (False, True):
            r = runs[rank][(*case, pipe)]
            assert r["skip_writes"] == 0 and not r["streaming"][SKIP], (case, pipe, rank, r["skip_writes"])


def test_a_failure_while_streaming_reaches_the_next_read_and_step(tmp_path, monkeypatch):
    """A write that fails in the background: every later read of the files it held, and the next
    step, raise an OffloadError naming the update and the cause, with what to do."""
    policy = fz.offload.nvme(str(tmp_path), params=True, buffer_mb=0.05, buffers=2, prefetch=1)
    state = fz.init(make_model(), spec(3, 1, precision="bf16", offload=policy))
    (b0, b1), real, calls = [r[0] for r in rank_batches(1, 1, 2)], offload_io.IOPool._io, []

    def failing(self, blob, offset, buf, write):
        calls.append(write)
        if write and calls.count(True) == 4:  # after the first group, in the background
            raise OSError(5, f"offload write of {blob.path} at byte {offset}: Input/output error")
        return real(self, blob, offset, buf, write)

    monkeypatch.setattr(offload_io.IOPool, "_io", failing)
    state, _ = fz.train_step(state, b0)  # returns: the update streams on and fails there
    with pytest.raises(fz.OffloadError, match=r"streamed optimizer update of the last step failed.*Input/output "
                                              r"error.*restore from the last checkpoint"):
        fz.full_params(state)
    with pytest.raises(fz.OffloadError, match="streamed optimizer update of the last step failed"):
        fz.train_step(state, b1)
    assert not pending.inflight()
    pending.join_inflight()  # told once (by the first read): a later step, on a restored state, is not failed


def test_a_gate_has_a_deadline(tmp_path):
    from fz.storage.gate import Gate
    from fz.storage.store import store_for
    blob = store_for(str(tmp_path), False).new_blob("gated", 4096)
    gate = Gate([blob], "a test update", deadline_s=0.2)
    with pytest.raises(fz.OffloadError, match=r"a test update has not finished writing it after 0 s"):
        blob.read(((0, 16),))
    gate.release(blob)
    assert blob.read(((0, 16),)).tolist() == [0] * 16 and blob.gate is None


def _late_sum():
    """A transformation that sums across shards only for the last block's parameters: the first
    group of the update does not show that the optimizer needs a collective."""
    def update(updates, state, params=None, *, shard_sum=None, **extra):
        last = {k: v for k, v in updates.items() if k.startswith("blocks.1.")}
        if last and shard_sum is not None:
            shard_sum({k: v.square().sum().reshape(1) for k, v in last.items()})
        return updates, state
    return fz.optim.GradientTransformation(lambda params: (), update)


def test_a_collective_in_a_later_group_stops_the_streamed_update_with_a_clear_error(tmp_path):
    opt = fz.optim.chain(_late_sum(), fz.optim.adamw(lr=1e-3))
    policy = fz.offload.nvme(str(tmp_path), params=True, buffer_mb=0.05, buffers=2, prefetch=1)
    state = fz.init(make_model(), spec(3, 1, optimizer=opt, offload=policy))
    (b0, b1) = [r[0] for r in rank_batches(1, 1, 2)]
    state, _ = fz.train_step(state, b0)
    with pytest.raises(fz.OffloadError, match=r"summed across shards .* pipeline=False"):
        fz.full_params(state)
    pending.join_inflight()
    waits = fz.init(make_model(), spec(3, 1, optimizer=opt, offload=policy.replace(pipeline=False)))
    for b in (b0, b1):
        waits, loss = fz.train_step(waits, b)  # without streaming on, the same optimizer trains
    assert math.isfinite(float(loss))
