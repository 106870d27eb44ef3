"""How processes end: a failed async save is never silent (the next fz call raises it, or the
process exits non-zero), and short world-2 stage-3 jobs with checkpoints all exit cleanly."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import fz

from support.helpers import make_model, rank_batches, spec
from support.timing import slowdown

TESTS = Path(__file__).parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1",
           PYTHONPATH=os.pathsep.join([str(TESTS), str(Path(fz.__file__).parent.parent)]))
SPARSE = {"sparse": torch.eye(2).to_sparse()}  # DCP cannot write it: the save fails in its thread


def _background_saves_done(timeout: float = 60.0) -> None:
    deadline = time.monotonic() + slowdown() * timeout  # a quiet machine's bound, scaled
    while any(t.name.startswith("fz-ckpt-") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the async save did not finish"
        time.sleep(0.02)


def test_a_failed_async_save_is_raised_by_the_next_fz_call(tmp_path):
    state = fz.init(make_model(), spec(0, 1))
    batch = rank_batches(1, 1, 1)[0][0]
    fz.save(state, tmp_path, async_=True, client_state=SPARSE)
    _background_saves_done()
    where = re.escape(str(tmp_path / "step_0"))
    with pytest.raises(fz.CheckpointError, match=rf"the async save of checkpoint {where} failed in the background: "
                                          r"CheckpointError: writing checkpoint .*NotImplementedError"):
        fz.train_step(state, batch)
    state, loss = fz.train_step(state, batch)  # raised once: training goes on if the caller chooses to
    assert torch.isfinite(loss)


def test_a_failed_async_save_at_exit_makes_the_process_exit_non_zero(tmp_path):
    code = (
        "import torch, fz\n"
        "from support.helpers import make_model, spec\n"
        "state = fz.init(make_model(), spec(0, 1))\n"
        f"fz.save(state, {str(tmp_path)!r}, async_=True, client_state={{'sparse': torch.eye(2).to_sparse()}})\n"
        "print('the program ends', flush=True)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, (res.returncode, res.stderr[-2000:])
    assert "the program ends" in res.stdout
    assert f"fz: error: the async save of checkpoint {tmp_path / 'step_0'} failed" in res.stderr, res.stderr[-2000:]
    assert "NotImplementedError" in res.stderr


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
    import fz.compat
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

    for module in (fz.sharding.comm, fz.ckpt.group, fz.compat):  # fz.compat: the all-gathers and reduce-scatters
        module.dist = Watched()
    for stage in (1, 3):
        state = fz.init(make_model(), spec(stage, 1))
        for per_rank in rank_batches(world, 1, 3):
            state, _ = fz.train_step(state, per_rank[rank])
        fz.eval_step(state, per_rank[rank])
        fz.save(state, f"{root}/s{stage}")
        fz.restore(fz.init(make_model(), spec(stage, 1)), f"{root}/s{stage}")
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

# nanobind's report of objects still alive at exit, for triton's objects only. exit_jobs.py
# gc.freeze()s its parent's heap before forking (so each child's exit need not walk it), and
# frozen objects are never collected: triton 3.9 (torch 2.15's CUDA wheels; torch._dynamo,
# which DTensor imports, imports it) holds a few nanobind objects in reference cycles, which
# then outlive the interpreter and are reported. `python -c "import torch._dynamo, gc;
# gc.freeze()"` prints the same; without gc.freeze nothing is printed. Nothing else is dropped.
_FROZEN_TRITON_LEAKS = re.compile(
    r'nanobind: leaked \d+ (instances|types|functions)!\n'
    r'|( - leaked instance 0x[0-9a-f]+ of type "triton\._C\.[\w.]+"'
    r'| - leaked (type|function) "[^"\n]*"| - \.\.\. skipped remainder)\n'
    r'|nanobind: this is likely caused by a reference counting issue in the binding code\.\n'
    r'See https://nanobind\.readthedocs\.io/en/latest/refleaks\.html\n?')


def _stderr_of_a_clean_exit(text: str) -> str:
    return _FROZEN_TRITON_LEAKS.sub("", text)


def test_only_frozen_triton_leak_reports_are_ignored():
    report = ('nanobind: leaked 1 instances!\n - leaked instance 0x7f0a of type "triton._C.libtriton.ir.attribute"\n'
              'nanobind: leaked 1 types!\n - leaked type "triton._C.libtriton.ir.location"\n - ... skipped remainder\n'
              'nanobind: this is likely caused by a reference counting issue in the binding code.\n'
              'See https://nanobind.readthedocs.io/en/latest/refleaks.html\n')
    assert _stderr_of_a_clean_exit(report) == ""
    abort = "terminate called without an active exception\n"
    assert _stderr_of_a_clean_exit(report + abort) == abort
    other = 'nanobind: leaked 1 instances!\n - leaked instance 0x7f0a of type "fz.Thing"\n'
    assert _stderr_of_a_clean_exit(other) == ' - leaked instance 0x7f0a of type "fz.Thing"\n'


@pytest.mark.slow  # the slow tier (.ci/run: -m slow)
def test_fifty_short_world2_stage3_jobs_with_checkpoints_all_exit_cleanly(tmp_path):
    res = subprocess.run([sys.executable, str(TESTS / "support" / "exit_jobs.py"), str(tmp_path), str(JOBS),
                          str(PARALLEL)], env=ENV, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    ranks = out["ranks"]
    assert len(ranks) == 2 * JOBS
    unclean = {k: v for k, v in ranks.items() if v[0] != "exit 0" or _stderr_of_a_clean_exit(v[1]).strip()}
    assert not unclean, unclean
    for job in range(JOBS):  # each job's checkpoints committed
        assert (tmp_path / f"ckpt_{job}" / "latest").read_text().split()[0] == "step_3"


def test_destroying_the_process_group_right_after_an_async_save_lets_it_commit(tmp_path):
    """dist.destroy_process_group() waits for the pending save: the checkpoint is committed
    (no step_N.tmp), both ranks exit 0, and it restores; a failing save still exits non-zero."""
    code = (
        "import sys, torch, torch.distributed as dist, fz\n"
        "from support.helpers import make_model, spec, rank_batches\n"
        "rank = int(sys.argv[1])\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/rdzv', rank=rank, world_size=2)\n"
        "state = fz.init(make_model(), spec(3, 1))\n"
        "state, _ = fz.train_step(state, rank_batches(2, 1, 1)[0][rank])\n"
        "bad = {'sparse': torch.eye(2).to_sparse()} if sys.argv[2] == 'fail' else None\n"
        f"fz.save(state, {str(tmp_path)!r} + '/' + sys.argv[2], async_=True, client_state=bad)\n"
        "dist.destroy_process_group()\n"
        "print('destroyed', flush=True)\n"
    )
    for how, want in (("ok", 0), ("fail", 1)):
        procs = [subprocess.Popen([sys.executable, "-c", code, str(r), how], env=ENV, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r in range(2)]
        outs = [p.communicate(timeout=300) for p in procs]
        (tmp_path / "rdzv").unlink(missing_ok=True)
        for p, (_out, err) in zip(procs, outs):
            assert (p.returncode != 0) == bool(want), (how, p.returncode, err[-2000:])
        if how == "ok":
            assert sorted(os.listdir(tmp_path / "ok")) == ["latest", "step_1"]
            restored = fz.restore(fz.init(make_model(), spec(0, 1)), tmp_path / "ok")
            assert int(restored.step) == 1
        else:
            assert "sparse" in outs[0][1] or "NotImplementedError" in outs[0][1], outs[0][1][-2000:]
            assert not (tmp_path / "fail" / "step_1").exists()
