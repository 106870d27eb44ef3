"""Elastic restart under torchrun --max-restarts (the killed run through `fz run`): a run killed at a
random step restarts from the latest checkpoint and ends with exactly the parameters of an uninterrupted run.

tests/support/elastic_job.py resumes from the latest checkpoint; on its first attempt its
rank 0 SIGKILLs itself before a step drawn at random; torchrun tears the job down and starts it
again (`fz run` forwards --max-restarts to the same launcher).
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # the slow tier: .ci/run runs it (-m slow)

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12


def torchrun(out: Path, kills: str, restarts: int, steps: int = STEPS, save_every: int = 2,
             timeout: float = 240, launcher: str = "torchrun") -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    start = ["torch.distributed.run", "--standalone"] if launcher == "torchrun" else ["fz", "run"]
    cmd = [sys.executable, "-m", *start, "--nproc-per-node", "2",
           "--max-restarts", str(restarts), "--monitor-interval", "0.2",
           str(ROOT / "tests" / "support" / "elastic_job.py"), str(out), str(steps), kills, str(save_every)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_killed_run_restarts_from_the_latest_checkpoint_and_ends_identical(tmp_path):
    kill_at = random.Random(os.getpid()).randrange(3, STEPS - 1)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = torchrun(tmp_path / "a" / "final.pt", "-1", 0)
    assert plain.returncode == 0, plain.stderr[-3000:]
    killed = torchrun(tmp_path / "b" / "final.pt", str(kill_at), 1, launcher="fz run")  # the same, through fz run
    assert killed.returncode == 0, (kill_at, killed.stderr[-3000:])
    assert "exitcode: -9" in killed.stderr, killed.stderr[-3000:]  # the victim was SIGKILLed...
    want = torch.load(tmp_path / "a" / "final.pt")
    got = torch.load(tmp_path / "b" / "final.pt")
    assert (want["attempt"], got["attempt"]) == (0, 1)  # ... and the job finished on its restart
    assert got["step"] == want["step"] == STEPS
    for name, t in want["params"].items():
        assert torch.equal(got["params"][name], t), (kill_at, name)
