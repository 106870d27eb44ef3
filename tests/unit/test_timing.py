"""tests/support/timing.py's slowdown sees busy cores: bounds scaled by it grow on a loaded machine."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from support.timing import slowdown


def test_slowdown_grows_with_busy_processes_on_every_core():
    cores = len(os.sched_getaffinity(0))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * cores)]
    try:
        time.sleep(0.3)  # they are running
        loaded = slowdown()
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert loaded > 1.5, loaded  # 2 x cores busy loops and this one: about 2

