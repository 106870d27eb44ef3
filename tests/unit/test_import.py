"""`import fz` patches nothing: no torch function replaced, no exit handler registered. The
safety nets are installed when they are first needed (fz/distributed/guards.py): an async
save, the heartbeat of a multi-rank group, a collective left in flight."""
from __future__ import annotations

import os
import subprocess
import sys

CHECK = """
import atexit
import torch.distributed as dist
destroy, before = dist.destroy_process_group, atexit._ncallbacks()
import fz, fz.ckpt, fz.distributed, fz.sharding.settle, fz.storage.store, fz.step.train
print(dist.destroy_process_group is destroy, dist.distributed_c10d.destroy_process_group is destroy,
      atexit._ncallbacks() - before)
"""

ASYNC = """
import atexit, tempfile
import torch.distributed as dist
import fz
from support.helpers import make_model, spec
destroy = dist.destroy_process_group
state = fz.init(make_model(), spec(0, 1))
before = atexit._ncallbacks()
fz.save(state, tempfile.mkdtemp(), async_=True)
fz.wait_for_checkpoints()
print(dist.destroy_process_group is destroy, atexit._ncallbacks() > before)
dist.destroy_process_group()
"""


def _run(code: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1].split()  # after fz.save's own lines


def test_import_fz_patches_nothing():
    assert _run(CHECK) == ["True", "True", "0"]


def test_an_async_save_installs_the_exit_guards():
    assert _run(ASYNC) == ["False", "True"]  # destroy_process_group now waits for pending saves


def test_messages_go_through_the_fz_logger_and_can_be_silenced(tmp_path, capsys):
    import logging

    import fz

    from support.helpers import make_model, spec

    state = fz.init(make_model(), spec(0, 1))
    fz.save(state, tmp_path / "shown")
    assert "fz: saved " in capsys.readouterr().out  # by default, on stdout as before
    log = logging.getLogger("fz")
    level = log.level
    log.setLevel(logging.WARNING)  # standard logging config silences it
    try:
        fz.save(state, tmp_path / "silent")
    finally:
        log.setLevel(level)
    assert "fz: saved " not in capsys.readouterr().out
