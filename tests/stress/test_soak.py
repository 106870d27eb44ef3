"""Soak, on demand (FZ_STRESS=1): a long run with a checkpoint every 50 steps and a rank SIGKILLed
at random steps (a different rank each restart), under torchrun --max-restarts; nothing is
lost: the final parameters equal an uninterrupted run's, bit for bit.

    FZ_STRESS=1 FZ_SOAK_STEPS=2000 FZ_SOAK_KILLS=6 OMP_NUM_THREADS=1 python -m pytest -q -s tests/stress/test_soak.py

Results go in benchmarks/RESULTS.md (the test prints the line to paste).
"""
from __future__ import annotations

import os
import random
import time

import pytest
import torch

from multirank.test_elastic import torchrun

pytestmark = pytest.mark.skipif(not os.environ.get("FZ_STRESS"), reason="stress test: set FZ_STRESS=1 to run it")


def test_soak_with_random_kills_loses_nothing(tmp_path):
    steps = int(os.environ.get("FZ_SOAK_STEPS", "2000"))
    n_kills = int(os.environ.get("FZ_SOAK_KILLS", "6"))
    rng = random.Random(int(os.environ.get("FZ_SOAK_SEED", "0")))
    kills = sorted(rng.sample(range(1, steps), n_kills))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    t0 = time.monotonic()
    plain = torchrun(tmp_path / "a" / "final.pt", "-1", 0, steps, 50, timeout=20 * steps)
    t1 = time.monotonic()
    killed = torchrun(tmp_path / "b" / "final.pt", ",".join(map(str, kills)), n_kills, steps, 50, timeout=40 * steps)
    t2 = time.monotonic()
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert killed.returncode == 0, (kills, killed.stderr[-3000:])
    want, got = torch.load(tmp_path / "a" / "final.pt"), torch.load(tmp_path / "b" / "final.pt")
    assert got["attempt"] == n_kills and got["step"] == want["step"] == steps
    same = all(torch.equal(got["params"][k], t) for k, t in want["params"].items())
    print(f"\nsoak: {steps} steps, save every 50, {n_kills} SIGKILLs at steps {kills}: "
          f"{'bit-identical' if same else 'DIFFERENT'} final params; uninterrupted {t1 - t0:.0f} s, "
          f"with kills and restarts {t2 - t1:.0f} s")
    assert same
