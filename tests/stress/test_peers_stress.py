"""On demand (FZ_STRESS=1): SIGKILL and SIGSTOP of a random rank at random moments, world 2 and 4,
10 trials each, saving every 3 steps so some signals land inside a checkpoint's collectives.

    FZ_STRESS=1 OMP_NUM_THREADS=1 python -m pytest -q tests/stress/test_peers_stress.py
"""
from __future__ import annotations

import os
import random
import signal

import pytest

from multirank.test_peers import check_trial

pytestmark = pytest.mark.skipif(not os.environ.get("FZ_STRESS"), reason="stress test: set FZ_STRESS=1 to run it")
CASES = [(w, s, t) for w in (2, 4) for s in (signal.SIGKILL, signal.SIGSTOP) for t in range(10)]


@pytest.mark.parametrize("world,sig,trial", CASES, ids=[f"ws{w}-{s.name}-{t}" for w, s, t in CASES])
def test_random_rank_lost_at_a_random_moment(world, sig, trial, tmp_path):
    seed = 1000 * world + 100 * int(sig) + trial
    check_trial(world, sig, random.Random(seed).randrange(world), seed, str(tmp_path))
