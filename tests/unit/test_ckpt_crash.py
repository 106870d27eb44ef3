"""Crash safety: a save killed with SIGKILL at any moment leaves `latest` naming a complete
checkpoint, and the previous checkpoint restores identically.

A worker process (this file run as a script; it imports torch once) forks one child per
kill: 10 named points of a save, in a synchronous and in an async save (the child wraps the
function at each phase boundary to SIGKILL itself there: see ckpt_hooks.POINTS), including
between the rename and the `latest` update, and random-time kills from outside. Each child
saves step 2, trains to step 4 and saves step 4 with keep_last=1 (so pruning runs too);
random-kill children then keep saving that state as steps 5, 6, ... until the kill lands.
Replacing children (`replace_*`) then train to step 6 and save it as step 4 again, killed at
each point of that save, the old copy's set-aside included: step 4 restores as the old copy
until `latest` names the new one, and as the new one after.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

POINTS = ["start", "write_begin", "written", "checksummed", "before_rename", "renamed", "latest_tmp_written",
          "latest_updated", "pruning", "done"]
AFTER_COMMIT = {"latest_updated", "pruning", "done"}  # `latest` already names step_4 there
KILLS = [*POINTS, *(f"async_{p}" for p in POINTS)]
REPLACE_KILLS = [f"replace_{p}" for p in [*POINTS[:4], "set_aside", *POINTS[4:]]]
RANDOM_KILLS = 6


def _model():
    from fz.testing.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=2048, seq=16, dim=128, heads=2, layers=2))


def _spec():
    from support.helpers import spec
    return spec(1, 1)


def _child(root: Path, kill: str, ready_fd: int = -1, ref: str = "", loop: bool = False,
           replace: bool = False) -> None:
    import fz
    from fz.ckpt import save, wait_for_checkpoints

    from support.ckpt_hooks import arm
    from support.helpers import rank_batches

    data = rank_batches(1, 1, 4)
    state = fz.init(_model(), _spec())
    for b in data[:2]:
        state, _ = fz.train_step(state, b[0] % 64)
    p2 = fz.full_params(state)
    save(state, root, keep_last=1)
    for b in data[2:]:
        state, _ = fz.train_step(state, b[0] % 64)
    p4 = fz.full_params(state)
    if replace:  # step 4 is committed: train on and save that step again
        save(state, root, keep_last=1)
        for b in data[2:]:
            state, _ = fz.train_step(state, b[0] % 64)
    async_ = kill.startswith("async_")
    if kill:
        arm(kill.split("_", 1)[1] if async_ or replace else kill, "kill")
    if ready_fd >= 0:
        os.write(ready_fd, b"x")
    t = time.perf_counter()
    save(state, root, step=4, keep_last=1, async_=async_)
    wait_for_checkpoints()
    for step in range(5, 1000 if loop else 0):  # random kills: keep saving until the kill lands
        save(state, root, step=step, keep_last=1)
    if ref:
        torch.save({2: p2, 4: p4, int(state.step): fz.full_params(state), "seconds": time.perf_counter() - t}, ref)


def _async_then_exit(root: Path) -> None:
    """An async save still writing (held back 0.3 s) when the program ends: exit waits for it."""
    import atexit

    import fz
    from fz.ckpt import save

    from support.ckpt_hooks import arm

    arm("write_begin", "sleep=0.3")
    save(fz.init(_model(), _spec()), root, async_=True)
    atexit._run_exitfuncs()  # what interpreter exit runs (fz registers wait_for_checkpoints there)


def _fork(fn, *args) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn(*args)
        except BaseException:  # noqa: BLE001 - report, then leave without running the parent's cleanup
            import traceback
            traceback.print_exc()
            code = 1
        os._exit(code)
    return pid


def _status(pid: int) -> str:
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return "killed" if os.WTERMSIG(status) == signal.SIGKILL else f"signal {os.WTERMSIG(status)}"
    return "exited" if os.WEXITSTATUS(status) == 0 else f"failed {os.WEXITSTATUS(status)}"


def worker(base: Path) -> dict:
    out = {"none": _status(_fork(_child, base / "none", "", -1, str(base / "ref.pt")))}
    out["replace"] = _status(_fork(_child, base / "replace", "", -1, str(base / "ref_replace.pt"), False, True))
    seconds = torch.load(base / "ref.pt")["seconds"]
    for p in KILLS:
        out[p] = _status(_fork(_child, base / p, p))
    for p in REPLACE_KILLS:
        out[p] = _status(_fork(_child, base / p, p, -1, "", False, True))
    rnd = random.Random(0)
    for i in range(RANDOM_KILLS):
        r, w = os.pipe()
        pid = _fork(_child, base / f"random{i}", "", w, "", True)
        os.read(r, 1)
        time.sleep(rnd.uniform(0, 2 * seconds))
        os.kill(pid, signal.SIGKILL)
        out[f"random{i}"] = _status(pid)
        os.close(r)
        os.close(w)
    out["async_exit"] = _status(_fork(_async_then_exit, base / "async_exit"))
    out["save_seconds"] = seconds
    return out


@pytest.mark.slow  # the slow tier (.ci/run: -m slow)
def test_sigkill_during_save_never_loses_the_previous_checkpoint(tmp_path):
    import fz
    from fz.ckpt import manifest, restore, save
    from fz.ckpt.layout import committed_steps, current, pointer, read_latest, step_name

    here = Path(__file__).parents[1]  # tests/; the child imports the fz this process imported, not an installed one
    path = os.pathsep.join([str(here), str(Path(fz.__file__).parent.parent)])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    res = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    status = json.loads(res.stdout.strip().splitlines()[-1])
    assert status["none"] == status["replace"] == "exited", res.stderr[-3000:]
    want = {**torch.load(tmp_path / "ref.pt"), **torch.load(tmp_path / "ref_replace.pt")}  # params by train step

    def same(state, step):
        got = fz.full_params(state)
        return int(state.step) == step and all(torch.equal(got[k], want[step][k]) for k in want[step])

    assert status["async_exit"] == "exited" and read_latest(tmp_path / "async_exit") == "step_0", status
    manifest.verify(tmp_path / "async_exit" / "step_0")
    leftovers = {}
    for name in ["none", "replace", *KILLS, *REPLACE_KILLS, *(f"random{i}" for i in range(RANDOM_KILLS))]:
        root = tmp_path / name
        if name not in ("none", "replace"):
            assert status[name] == "killed", (name, status[name])
        latest = read_latest(root)
        manifest.verify(current(root, latest, pointer(root)[1]))  # `latest` names a complete checkpoint
        if name in KILLS:
            assert latest == ("step_4" if name.replace("async_", "") in AFTER_COMMIT else "step_2"), (name, latest)
        trained = {"step_2": 2, "step_4": 4}.get(latest, 4)
        if name.startswith("replace"):  # the old step 4 until `latest` names the new one (trained to 6)
            assert latest == "step_4", (name, latest)
            trained = 6 if name == "replace" or name[len("replace_"):] in AFTER_COMMIT else 4
        assert same(restore(fz.init(_model(), _spec()), root), trained), name
        for n in committed_steps(root):  # every other committed checkpoint (the previous one) is intact
            if step_name(n) != latest:
                assert same(restore(fz.init(_model(), _spec()), root, step=n), 2 if n == 2 else 4), (name, n)
        # the next save clears the leftovers of the crash and commits
        leftovers[name] = sorted(p.name for p in root.iterdir())
        save(fz.init(_model(), _spec()), root, step=9999, keep_last=1)
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_9999"], (name, sorted(os.listdir(root)))
    print("directories after each kill:", leftovers)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parents[1]))
    import torch._dynamo  # noqa: F401 - imported once here, not in every child (DTensor imports it lazily)
    import torch.distributed.checkpoint  # noqa: F401

    import fz.ckpt  # noqa: F401
    print(json.dumps(worker(Path(sys.argv[1]))))
