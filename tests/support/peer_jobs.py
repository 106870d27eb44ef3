"""A rank of a training job that a test kills or stops: `python tests/support/peer_jobs.py TIMEOUT_S [CKPT_DIR]`.

Started by tests/multirank/test_peers.py with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set and the
job's store hosted by the test (as torchrun's agent hosts it), so any rank may be the victim.
It trains a small model until stopped, saving every few steps when CKPT_DIR is given (with
FZ_TEST_JOB=generate it calls fz.generate on a tiny Llama instead; with FZ_TEST_JOB=own_group
it starts the process group itself before fz.init), prints `ready` after its first step, and
on fz.PeerError prints `PEERERROR <ranks> <step> <message>` and exits 3 (any other exception
exits 1).
"""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F

import fz


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))

    def forward(self, x):
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        return x


def main() -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test dumps a hanging rank's stacks
    timeout_s = float(sys.argv[1])
    ckpt = sys.argv[2] if len(sys.argv) > 2 else None
    stage = int(os.environ.get("FZ_TEST_STAGE", "3"))
    torch.set_num_threads(1)
    if os.environ.get("FZ_TEST_JOB") == "generate":
        return _generate(timeout_s, stage)
    if os.environ.get("FZ_TEST_JOB") == "own_group":  # the script starts the group, with gloo's timeout at 120 s
        torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=120))
    spec = fz.Spec(stage=stage, timeout_s=timeout_s, loss_fn=lambda m, b: F.mse_loss(m(b), b), bucket_mb=0.002)
    torch.manual_seed(0)
    state = fz.init(Net(), spec)
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    try:
        for step in range(100000):
            state, loss = fz.train_step(state, torch.randn(8, 32, generator=g))
            if step == 0:
                print("ready", flush=True)
            if ckpt and step % 3 == 2:
                fz.save(state, ckpt, keep_last=2)
            time.sleep(0.005)
    except fz.PeerError as e:
        print(f"PEERERROR {list(e.ranks)} {e.step} {e}", flush=True)
        return 3
    return 0


def _generate(timeout_s: float, stage: int) -> int:
    """fz.generate in a loop (a tiny Llama; "auto" agrees on a plan per call, "gather" then only
    runs HF's end-of-loop check per token), printing `ready` after the first call."""
    from support.generate_jobs import prompts, tiny

    logging.getLogger("fz").setLevel(logging.WARNING)  # no plan line per call: the test reads `ready` first
    state = fz.init(tiny("llama"), fz.Spec(stage=stage, timeout_s=timeout_s, bucket_mb=0.002))
    ids, mask = prompts(int(os.environ["RANK"]))
    try:
        for call in range(100000):
            fz.generate(state, ids, mask, residency=("auto", "gather")[call % 2], max_new_tokens=8, do_sample=False)
            if call == 0:
                print("ready", flush=True)
    except fz.PeerError as e:
        print(f"PEERERROR {list(e.ranks)} {e.step} {e}", flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
