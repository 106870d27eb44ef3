"""Many short world-2 stage-3 jobs with checkpoints, each ending with a real interpreter exit.

Run as a script: `python exit_jobs.py ROOT JOBS PARALLEL`. It imports torch and fz once and
forks two ranks per job (each child returns to the top level and exits the normal way, so
interpreter finalization runs as in a real job); it prints one JSON line: every rank's exit
status and what it wrote to stderr. A job trains three steps, saves asynchronously on the
way and synchronously at the end, and ends without destroy_process_group (odd jobs) or
after it (even ones). Fresh processes cost ~4 s of CPU each here (imports), forked ones
~0.4 s. (Forked children did not hit the exit-time abort even before its fix: 0 of 690
ranks, against about 1 in 60 fresh ones; test_exit's gloo-thread test checks its cause.)
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

import torch


def _job(rank: int, root: Path, index: int, port: int) -> None:
    import torch.distributed as dist

    import fz
    from fz.testing.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=2))
    state = fz.init(model, fz.Spec(stage=3, loss_fn=lm_loss))
    ckpt = root / f"ckpt_{index}"
    for step in range(3):
        state, _ = fz.train_step(state, synthetic_tokens(2, 8, 32, seed=10 * step + rank))
        if step == 1:
            fz.save(state, ckpt, async_=True)
    fz.save(state, ckpt)
    if index % 2 == 0:
        dist.destroy_process_group()


def _run_child(rank: int, root: Path, index: int, port: int) -> None:
    """In the forked child: run the job, then leave through the top level (a normal exit)."""
    err = os.open(root / f"err_{index}_{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)
    os.close(err)
    sys.stderr = os.fdopen(2, "w", closefd=False)
    code = 0
    try:
        _job(rank, root, index, port)
    except BaseException:  # noqa: BLE001 - a failed job is a failed rank
        import traceback
        traceback.print_exc()
        code = 3
    raise SystemExit(code)


def _status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit {os.WEXITSTATUS(status)}"


def main(root: Path, jobs: int, parallel: int) -> dict:
    from fz.testing.spawn import free_port

    gc.freeze()  # the children's exits need not walk the parent's heap (0.9 s of CPU each, else)
    running: dict = {}  # pid -> (job, rank)
    out: dict = {}
    nxt = 0
    while nxt < jobs or running:
        while nxt < jobs and len(running) < 2 * parallel:
            port = free_port()
            for rank in (0, 1):
                pid = os.fork()
                if pid == 0:
                    _run_child(rank, root, nxt, port)
                running[pid] = (nxt, rank)
            nxt += 1
        pid, status = os.wait()
        job, rank = running.pop(pid)
        text = (root / f"err_{job}_{rank}").read_text(errors="replace")
        out[f"{job}/{rank}"] = (_status(status), text[-8000:])  # whole, for a leak report to be told apart
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    import torch._dynamo  # noqa: F401 - imported once here, not in every child
    import torch.distributed.checkpoint  # noqa: F401

    import fz  # noqa: F401

    t = time.perf_counter()
    res = main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
    print(json.dumps({"ranks": res, "seconds": time.perf_counter() - t}))
