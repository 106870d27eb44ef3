"""A training script that survives restarts:
`torchrun --max-restarts N tests/support/elastic_job.py OUT STEPS KILLS [SAVE_EVERY]`.

It resumes from the latest checkpoint (if any) and saves every SAVE_EVERY (2) steps. KILLS is
a comma-separated step per restart attempt (TORCHELASTIC_RESTART_COUNT): on attempt i, rank
i % world SIGKILLs itself before step KILLS[i] (-1 or no entry: never). Rank 0 writes the
final full parameters to OUT. tests/multirank/test_elastic.py (and the soak in tests/stress/) compare
a killed and restarted run with an uninterrupted one.
"""
from __future__ import annotations

import os
import signal
import sys

import torch
import torch.nn.functional as F

import fz
from fz.testing.gpt import GPT, GPTConfig, synthetic_tokens

CFG = GPTConfig(vocab=64, seq=16, dim=32, heads=2, layers=2)


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.data = synthetic_tokens(512, CFG.seq, CFG.vocab, seed=0)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


def loss_fn(model, batch):
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def main() -> None:
    out, steps, kills = sys.argv[1], int(sys.argv[2]), [int(k) for k in sys.argv[3].split(",")]
    save_every = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    spec = fz.Spec(stage=3, optimizer=fz.optim.adamw(lr=1e-2), micro_batch=4, loss_fn=loss_fn, clip_grad_norm=1.0,
                   timeout_s=20.0)
    torch.manual_seed(0)
    state = fz.init(GPT(CFG), spec)
    kill_at = kills[attempt] if attempt < len(kills) else -1
    victim = state.plan.rank == attempt % state.plan.world
    with fz.Checkpointer(os.path.join(os.path.dirname(out), "ckpt"), keep_last=2, verbose=False) as ckpt:
        if ckpt.latest_step() is not None:  # a restart: continue from the latest checkpoint
            state = ckpt.restore(state)
        loader = fz.data.loader(Tokens(), state)
        for batch in loader:
            if int(state.step) >= steps:
                break
            if victim and int(state.step) == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            state, _ = fz.train_step(state, batch)
            if int(state.step) % save_every == 0:
                ckpt.save(loader.attach(state))
    full = fz.full_params(state)
    if state.plan.rank == 0:
        torch.save({"step": int(state.step), "params": full,
                    "attempt": attempt}, out)


if __name__ == "__main__":
    main()
