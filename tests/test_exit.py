"""How processes end: no collective's tensors are left to gloo's threads, and short world-2
stage-3 jobs with checkpoints all exit cleanly."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

import fz
from helpers import make_model, rank_batches, spec

HERE = Path(__file__).parent
ENV = dict(os.environ, OMP_NUM_THREADS="1",
           PYTHONPATH=os.pathsep.join([str(HERE), str(Path(fz.__file__).parent.parent)]))


_COLLECTIVES = {"all_reduce", "broadcast", "all_gather_single", "reduce_scatter_single", "isend", "irecv", "all_gather",
                "all_gather_into_tensor", "reduce_scatter_tensor"}


def _where_collective_tensors_die(rank: int, world: int, root: str) -> list:
    """Train (stages 1 and 3), evaluate, save and restore with every tensor fz hands to a
    collective watched: the collectives whose tensors' Python objects were freed by one of
    gloo's threads (what aborts at interpreter exit when it is a job's last collective)."""
    import gc
    import weakref

    import torch.distributed as dist

    import fz.ckpt.group
    import fz.sharding.comm

    foreign: list = []

    def died(name: str) -> None:
        if isinstance(threading.current_thread(), threading._DummyThread):  # a thread Python did not start
            foreign.append(name)

    class Watched:
        """torch.distributed as fz's modules see it."""

        def __getattr__(self, name):
            real = getattr(dist, name)
            if name not in _COLLECTIVES:
                return real

            def call(*args, **kwargs):
                for t in [*args, *kwargs.values()]:
                    if isinstance(t, torch.Tensor):
                        weakref.finalize(t, died, name)
                return real(*args, **kwargs)
            return call

    for module in (fz.sharding.comm, fz.ckpt.group):
        module.dist = Watched()
    for stage in (1, 3):
        state = fz.init(make_model(), spec(stage, 1))
        for per_rank in rank_batches(world, 1, 3):
            state, _ = fz.train_step(state, per_rank[rank])
        fz.eval_step(state, per_rank[rank])
        fz.save(state, f"{root}/s{stage}")
        fz.restore(f"{root}/s{stage}", fz.init(make_model(), spec(stage, 1)))
    del state
    gc.collect()
    time.sleep(0.2)
    return foreign


def test_no_tensor_of_an_fz_collective_is_freed_by_a_gloo_thread(tmp_path):
    """gloo's worker thread frees a tensor's Python object when Python dropped it first, taking
    the GIL; at interpreter exit that ends in "terminate called without an active exception"."""
    from fz.testing.spawn import run_ranks

    for rank, foreign in enumerate(run_ranks(2, _where_collective_tensors_die, str(tmp_path), timeout=300)):
        assert not foreign, (rank, len(foreign), sorted(set(foreign)))


JOBS, PARALLEL = 50, 2


def test_fifty_short_world2_stage3_jobs_with_checkpoints_all_exit_cleanly(tmp_path):
    res = subprocess.run([sys.executable, str(HERE / "exit_jobs.py"), str(tmp_path), str(JOBS), str(PARALLEL)],
                         env=ENV, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    ranks = out["ranks"]
    assert len(ranks) == 2 * JOBS
    unclean = {k: v for k, v in ranks.items() if v[0] != "exit 0" or v[1].strip()}
    assert not unclean, unclean
    for job in range(JOBS):  # each job's checkpoints committed
        assert (tmp_path / f"ckpt_{job}" / "latest").read_text() == "step_3"
