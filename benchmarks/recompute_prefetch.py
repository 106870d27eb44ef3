"""Stage 3 with every block checkpointed, world 2: the step time and the gathers that found no
prefetch in flight (backward's recompute gathers each block again), for the fz in the current
directory. Run it from two checkouts in turn to compare them:

    cd <checkout> && OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/recompute_prefetch.py --precision bf16

Prints one line per rank: (median step ms over the steps after the first 3, unprefetched gathers
of the last step, the last loss).
"""
from __future__ import annotations

import argparse
import time

import torch

import fz
from fz.testing.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens
from fz.testing.spawn import run_ranks

CFG = GPTConfig(vocab=4096, seq=256, dim=384, heads=6, layers=8)


def job(rank: int, world: int, precision: str, steps: int) -> tuple[int, int, float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    spec = fz.Spec(stage=3, precision=precision, optimizer=fz.optim.adamw(lr=1e-4), clip_grad_norm=1.0,
                   loss_fn=lm_loss, activation_checkpointing=True)
    state = fz.init(GPT(CFG), spec)
    data = synthetic_tokens(4 * steps * world, CFG.seq, CFG.vocab, seed=0)
    times, loss = [], 0.0
    for i in range(steps):
        batch = data[(i * world + rank) * 4:(i * world + rank + 1) * 4]
        t = time.perf_counter()
        state, out = fz.train_step(state, batch)
        loss = float(out)
        times.append(time.perf_counter() - t)
    kept = sorted(times[3:])
    return round(1000 * kept[len(kept) // 2]), int(state.metrics["unprefetched"]), loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args()
    print(run_ranks(2, job, a.precision, a.steps), flush=True)


if __name__ == "__main__":
    main()
