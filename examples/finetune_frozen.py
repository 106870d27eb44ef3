"""Fine-tune a pretrained model with most of it frozen and a small adapter, with fz.

The "pretrained" weights come from a safetensors file, as they would from a download;
here the example writes that file first (a randomly initialised trunk stands in for a
real one). Frozen parameters (requires_grad=False) get no gradient and no optimizer
state: the optimizer holds Adam's moments for the adapter and the head only.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 examples/finetune_frozen.py
    .venv/bin/python examples/finetune_frozen.py --ci       # one process, a short run
"""
from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.data import Dataset

import fz


class Trunk(nn.Module):
    """The pretrained part: an MLP of residual blocks (ZeRO-3 gathers one block at a time)."""

    def __init__(self, features: int = 16, dim: int = 128, depth: int = 6):
        super().__init__()
        self.inp = nn.Linear(features, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU()) for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return h


class Adapter(nn.Module):
    """A low-rank residual (LoRA-style): starts as the identity, since `up` starts at zero."""

    def __init__(self, dim: int, rank: int = 4):
        super().__init__()
        self.down, self.up = nn.Parameter(torch.empty(rank, dim)), nn.Parameter(torch.empty(dim, rank))
        self.reset_parameters()

    def reset_parameters(self) -> None:  # built on the meta device, fz.init calls this to make the values
        nn.init.normal_(self.down, std=0.02)
        nn.init.zeros_(self.up)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + h @ self.down.T @ self.up.T


class Finetuned(nn.Module):
    def __init__(self, classes: int = 4):
        super().__init__()
        self.trunk = Trunk()
        self.adapter = Adapter(128)
        self.head = nn.Linear(128, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.adapter(self.trunk(x)))


class Task(Dataset):
    """The fine-tuning data: 16 features, 4 classes (the quadrant of two hidden projections)."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 16, generator=g)
        w = torch.randn(16, 2, generator=torch.Generator().manual_seed(99))
        z = self.x @ w
        self.y = (z[:, 0] > 0).long() * 2 + (z[:, 1] > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def write_pretrained(path: Path) -> None:
    """Stand-in for a download: a trunk's weights, named as in the fine-tuned model."""
    torch.manual_seed(1234)
    trunk = Trunk()
    save_file({f"trunk.{k}": v.contiguous() for k, v in trunk.state_dict().items()}, str(path))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--weights", default="pretrained_trunk.safetensors")
    ap.add_argument("--ci", action="store_true", help="a short run")
    args = ap.parse_args()
    steps = 60 if args.ci else args.steps

    rank, world = fz.distributed.init()
    if rank == 0 and not Path(args.weights).exists():
        write_pretrained(Path(args.weights))
    torch.distributed.barrier()  # the file exists before any rank reads it

    with torch.device("meta"):  # no memory spent on values the file replaces
        model = Finetuned()
    for p in model.trunk.parameters():
        p.requires_grad_(False)  # frozen: no gradient, no optimizer state
    spec = fz.Spec(stage=2, optimizer=fz.optim.adamw(lr=3e-3), micro_batch=32, loss_fn=loss_fn)
    state = fz.init(model, spec)
    with warnings.catch_warnings(record=True) as notes:  # the file has the trunk only
        warnings.simplefilter("always")
        state = fz.load_weights(state, args.weights, strict=False)
    if rank == 0:
        for note in notes:  # the adapter and head are new: they keep fz.init's values
            print(f"load_weights (expected: the file holds the trunk, the adapter and head are new): {note.message}")

    mem = fz.memory_report(state)
    if rank == 0:
        adam_all = 8 * mem.num_params / (world if spec.stage >= 1 else 1)
        print(f"trainable {mem.num_trainable:,} of {mem.num_params:,} parameters; optimizer state on this rank "
              f"{mem.opt:,} bytes (Adam for every parameter would be {adam_all:,.0f})")

    loader = fz.data.loader(Task(4096, seed=0), state)
    monitor = fz.Monitor(log_every=20, total_steps=steps)
    losses = []
    for batch in loader:
        if int(state.step) >= steps:
            break
        state, loss = fz.train_step(state, batch)
        monitor(state, loss, batch)
        losses.append(float(loss))
    monitor.close()

    full = fz.full_params(state)  # every rank: the frozen trunk is exactly the file's
    if rank == 0:
        from safetensors.torch import load_file
        same = all(torch.equal(full[k], v) for k, v in load_file(args.weights).items())
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; frozen trunk unchanged: {same}")


if __name__ == "__main__":
    main()
