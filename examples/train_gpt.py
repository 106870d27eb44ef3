"""Train a small GPT on synthetic tokens with fz (ZeRO stage 3 by default).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 examples/train_gpt.py
    python examples/train_gpt.py --stage 0          # one process works too

Each rank draws its own synthetic rows; the printed loss is the mean over all ranks.
TensorBoard scalars go to --logdir (rank 0 writes them).
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import fz
from fz.testing.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--logdir", default="runs/train_gpt")
    args = ap.parse_args()

    if "RANK" in os.environ:
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    cfg = GPTConfig(vocab=512, seq=64, dim=128, heads=4, layers=4)
    with torch.device("meta"):  # fz materialises only this rank's shard, module by module
        model = GPT(cfg)
    spec = fz.Spec(stage=args.stage, optimizer=fz.optim.adamw(lr=args.lr, weight_decay=0.01),
                   grad_accum=args.grad_accum, clip_grad_norm=1.0, loss_fn=lm_loss, seed=0,
                   log_dir=args.logdir or None, log_every=10)
    state = fz.init(model, spec)
    if rank == 0:
        print(fz.memory_report(state))
    monitor = fz.Monitor.from_spec(spec, total_steps=args.steps)  # TensorBoard + a console line
    rows = args.micro_batch * args.grad_accum
    for step in range(args.steps):
        batch = synthetic_tokens(rows, cfg.seq, cfg.vocab, seed=step * 1000 + rank)
        state, loss = fz.train_step(state, batch)
        monitor(state, loss)
    monitor.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
