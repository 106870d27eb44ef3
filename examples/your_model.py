"""The shortest complete fz program for your own nn.Module and Dataset: init, data loader,
train loop, eval, a checkpoint every N steps, resume, export. Copy it and replace the
three parts marked YOURS.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 examples/your_model.py
    (run it again with a larger --steps: it resumes from checkpoints/your_model, data position included)
    .venv/bin/python examples/your_model.py --ci            # one process, a short run
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils.data import Dataset

import fz


class MyModel(nn.Module):  # YOURS: any nn.Module (the elements of a ModuleList are the blocks ZeRO-3 gathers)
    def __init__(self, features: int = 8, dim: int = 64, depth: int = 4):
        super().__init__()
        self.inp = nn.Linear(features, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU()) for _ in range(depth)
        )
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h).squeeze(-1)


class MyData(Dataset):  # YOURS: __len__ and __getitem__ (or an IterableDataset); samples may be dicts
    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.sin(self.x @ torch.linspace(-1, 1, 8))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i]}


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:  # YOURS: (model, batch) -> a scalar
    return F.mse_loss(model(batch["x"]), batch["y"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400, help="train until this step (a rerun resumes up to it)")
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--ckpt-dir", default="checkpoints/your_model")
    ap.add_argument("--ci", action="store_true", help="a short run")
    args = ap.parse_args()
    steps = 40 if args.ci else args.steps

    rank, _ = fz.distributed.init()  # under torchrun: the job's process group; alone: a group of one
    spec = fz.Spec(stage=3, optimizer=fz.optim.adamw(lr=3e-3), micro_batch=32, loss_fn=loss_fn, clip_grad_norm=1.0)
    state = fz.init(MyModel(), spec)
    ckpt = fz.Checkpointer(args.ckpt_dir, keep_last=2)
    if ckpt.latest_step() is not None:
        state = ckpt.restore(state)  # weights, optimizer, step, RNG and the data position
    train = fz.data.loader(MyData(8192, seed=0), state)  # this rank's micro_batch * grad_accum rows per step
    monitor = fz.Monitor("runs/your_model", log_every=20, total_steps=steps)

    losses = []
    for batch in train:
        if int(state.step) >= steps:
            break
        state, loss = fz.train_step(state, batch)
        monitor(state, loss, batch)
        losses.append(float(loss))
        if int(state.step) % 20 == 0:
            heldout = fz.data.loader(MyData(512, seed=1), spec, shuffle=False, epochs=1)
            held = [float(fz.eval_step(state, b)) for b in heldout]  # not `losses`: the training ones
            monitor.log({"eval/loss": sum(held) / len(held)}, int(state.step))
        if int(state.step) % args.save_every == 0:
            ckpt.save(train.attach(state))  # every rank; the data position goes with it
    if ckpt.latest_step() != int(state.step):
        ckpt.save(train.attach(state))
    ckpt.close()  # waits for the last save
    monitor.close()

    if rank == 0:  # export: one safetensors file of the full weights (the CLI: fz consolidate CKPT OUT)
        fz.ckpt.consolidate(args.ckpt_dir, "your_model.safetensors")
        model = MyModel()
        model.load_state_dict(load_file("your_model.safetensors"))  # plain PyTorch from here on
        test = MyData(512, seed=1)
        with torch.no_grad():
            exported = F.mse_loss(model(test.x), test.y).item()
        trained = (f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; " if losses else
                   f"nothing left to train: {args.ckpt_dir} is at step {int(state.step)}, and --steps {steps} "
                   "stops there (pass a larger --steps to go on); ")
        print(f"{trained}the exported model's held-out loss: {exported:.4f}")


if __name__ == "__main__":
    main()
