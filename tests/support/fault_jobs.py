"""A rank of a two-rank job that a fault test breaks: `python tests/support/fault_jobs.py MODE TIMEOUT_S CKPT_DIR`.

Started by tests/multirank/test_faults.py with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set and
no store of the test's: rank 0 hosts the job's store (env://), as when fz starts the group itself.
Modes:
- `frozen`: train until stopped (the test SIGSTOPs rank 0 after `ready`);
- `kill_save`: rank 1 SIGKILLs itself right before fz.save at step 2;
- `kill_full_params`: rank 0 SIGKILLs itself right before fz.full_params at step 2;
- `raise_fwd`: rank 0's loss_fn raises at step 2 (stage 3, mid-forward); rank 0 catches it and steps again;
- `stuck_write`: rank 1's checkpoint write hangs (FZ_CKPT_TIMEOUT is small);
- `kill_async`: rank 1 SIGKILLs itself as its async save's write begins (in DCP's thread);
- `crash_save`, `crash_step`: rank 1's script raises (uncaught) right before fz.save at step 2,
  or before step 2 while rank 0 steps on;
- `stop_join`: rank 1 SIGSTOPs itself before fz.init (it never joins the job);
- `stop_start`: rank 0 (the store's host) SIGSTOPs itself in fz.init, as the group starts;
- `kill_start`: rank 1 SIGKILLs itself in fz.init, as the group starts.
Prints `ready` after the first step, `PEERERROR <ranks> <seconds since the fault> <message>` on
fz.PeerError (exit 3), `REFUSED <message>` when raise_fwd's second step is refused (exit 0).
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

import fz

from support.ckpt_hooks import arm
from support.peer_jobs import Net


def main() -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    mode, timeout_s, ckpt = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)

    def loss_fn(m, b):
        if mode == "raise_fwd" and rank == 0 and int(state.step) == 2:
            raise RuntimeError("injected: the loss failed")
        return F.mse_loss(m(b), b)

    spec = fz.Spec(stage=3, timeout_s=timeout_s, loss_fn=loss_fn, bucket_mb=0.002)
    torch.manual_seed(0)
    _break_start(mode, rank)
    g = torch.Generator().manual_seed(rank)
    t0 = time.monotonic()
    try:
        state = fz.init(Net(), spec)
        for step in range(100000):
            if step == 2 and mode in ("crash_save", "crash_step") and rank == 1:
                raise RuntimeError("injected: the data loader failed")
            if step == 2 and mode == "kill_save" and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == 2 and mode == "kill_full_params" and rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == 2 and mode == "kill_async":
                t0, saver = time.monotonic(), fz.Checkpointer(ckpt, async_=True, verbose=False)
                if rank == 1:
                    arm("write_begin", "kill")
                saver.save(state)
                saver.wait()
                return 0
            if step == 2 and mode in ("kill_save", "kill_full_params", "stuck_write", "crash_save"):
                t0 = time.monotonic()
                if mode == "stuck_write" and rank == 1:
                    arm("write_begin", "sleep=60")
                if mode == "kill_full_params":
                    fz.full_params(state)
                else:
                    fz.save(state, ckpt)
                return 0
            if step == 2 and mode in ("raise_fwd", "crash_step"):
                t0 = time.monotonic()
            try:
                state, loss = fz.train_step(state, torch.randn(8, 32, generator=g))
            except RuntimeError as e:
                if isinstance(e, fz.PeerError) or "injected" not in str(e):
                    raise
                try:
                    fz.train_step(state, torch.randn(8, 32, generator=g))
                except fz.PeerError as refused:
                    print(f"REFUSED {refused}", flush=True)
                    time.sleep(timeout_s + 6)  # the other rank probes it still alive, then exits
                    return 0
            time.sleep(0.005)
            print("ready" if step == 0 else "", end="\n" if step == 0 else "", flush=True)
    except fz.PeerError as e:
        print(f"PEERERROR {list(e.ranks)} {time.monotonic() - t0:.1f} {e}", flush=True)
        return 3
    return 0


def _break_start(mode: str, rank: int) -> None:
    """The start-up faults: stop before fz.init, or stop / die as fz.init starts the group."""
    if mode == "stop_join" and rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    how = {("stop_start", 0): signal.SIGSTOP, ("kill_start", 1): signal.SIGKILL}.get((mode, rank))
    if how is not None:
        plain = torch.distributed.init_process_group

        def broken(*args, **kwargs):
            os.kill(os.getpid(), how)
            return plain(*args, **kwargs)

        torch.distributed.init_process_group = broken


if __name__ == "__main__":
    raise SystemExit(main())
