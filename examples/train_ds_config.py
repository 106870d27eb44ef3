"""Train the tiny GPT from a DeepSpeed JSON config (examples/ds_config.json by default).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 examples/train_ds_config.py
    python examples/train_ds_config.py --config my_ds_config.json   # one process works too

The config decides the ZeRO stage, batch sizes (train = micro * accumulation * world),
clipping, precision, optimizer and lr schedule; `spec.explain()` prints where every value
came from. The model, data and loss stay in code, as with DeepSpeed.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

import fz
from fz.testing.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(Path(__file__).with_name("ds_config.json")))
    ap.add_argument("--steps", type=int, default=None, help="default: the scheduler's total_num_steps, else 50")
    args = ap.parse_args()

    if "RANK" in os.environ:
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    # The world size comes from torch.distributed; "auto" values would come from keywords here.
    spec = fz.Spec.from_deepspeed(args.config).replace(loss_fn=lm_loss)
    if rank == 0:
        print(spec.explain(), flush=True)
    total = spec.provenance.get("scheduler.total_num_steps", (None, ""))[0]
    steps = args.steps or total or 50

    cfg = GPTConfig(vocab=256, seq=32, dim=64, heads=4, layers=2)
    with torch.device("meta"):
        model = GPT(cfg)
    state = fz.init(model, spec)
    monitor = fz.Monitor.from_spec(spec, total_steps=steps)  # tensorboard + steps_per_print, rank 0

    rows = spec.grad_accum * spec.micro_batch  # this rank's rows per optimizer step
    for step in range(steps):
        batch = synthetic_tokens(rows, cfg.seq, cfg.vocab, seed=step * 1000 + rank)
        state, loss = fz.train_step(state, batch)
        monitor(state, loss)  # loss, the lr the schedule applied (fz.optim.current_lr), steps/s
    monitor.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
