"""Shared set-up: one thread per process, and the machine's measured load for bounds on wall time."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from support.timing import Slowdown  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def load() -> Slowdown:
    """The machine's slowdown around a module's multi-rank runs (tests/support/timing.py): the
    fixture that runs them does it `with load:`, and a test bounds a time by `load.scaled(quiet_s)`."""
    return Slowdown()
