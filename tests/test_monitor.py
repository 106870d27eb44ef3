"""The Monitor writes TensorBoard scalars and a console line; the step itself stays pure."""
from __future__ import annotations

import io

import fz
from helpers import make_model, rank_batches, spec


def test_monitor_writes_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    state = fz.init(make_model(), spec(0, 1, log_dir=str(tmp_path), log_every=2))
    out = io.StringIO()
    monitor = fz.Monitor(state.spec.log_dir, state.spec.log_every, total_steps=4, stream=out)
    losses = []
    for per_rank in rank_batches(1, 1, 4):
        state, loss = fz.train_step(state, per_rank[0])
        monitor(state, loss)
        losses.append(float(loss))
    monitor.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    logged = [e.value for e in events.Scalars("train/loss")]
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    assert all(abs(a - b) < 1e-6 for a, b in zip(logged, losses))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 1/4  loss") and lines[-1].startswith("step 4/4  loss")
    assert len(lines) == 3  # first step, then every log_every=2 steps
