"""`Monitor`: TensorBoard scalars and a console progress line, outside the pure step.

The step stays a function; the training loop hands each (state, loss) to a Monitor,
which writes on rank 0 only (DeepSpeed's `tensorboard` and `steps_per_print`).
"""
from __future__ import annotations

import math
import sys
import time
from typing import Optional

import torch.distributed as dist
from torch import Tensor

from fz.state import State


class Monitor:
    """Logs loss, learning rate, loss scale and steps/s every `log_every` steps (rank 0)."""

    def __init__(self, log_dir: Optional[str] = None, log_every: int = 10, total_steps: Optional[int] = None,
                 stream=sys.stdout):
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.log_every, self.total, self.stream = log_every, total_steps, stream
        self.writer = None
        if log_dir and self.rank == 0:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir)
        self.start = time.perf_counter()
        self.seen = 0

    @classmethod
    def from_spec(cls, spec, total_steps: Optional[int] = None) -> "Monitor":
        return cls(spec.log_dir, spec.log_every, total_steps)

    def __call__(self, state: State, loss: Tensor) -> None:
        self.seen += 1
        step = int(state.step)
        m = state.metrics
        scalars = {"train/loss": float(loss)}
        for key, name in (("lr", "train/lr"), ("grad_norm", "train/grad_norm")):
            if not math.isnan(float(m[key])):
                scalars[name] = float(m[key])
        if state.scaler is not None:
            scalars["train/loss_scale"] = float(m["loss_scale"])
            scalars["train/skipped_steps"] = float(m["skipped"])
        if self.rank != 0:
            return
        if self.writer is not None:
            for k, v in scalars.items():
                self.writer.add_scalar(k, v, step)
        if step % self.log_every == 0 or step == self.total or self.seen == 1:
            rate = self.seen / (time.perf_counter() - self.start)
            of = f"/{self.total}" if self.total else ""
            extra = "  ".join(f"{k.split('/')[1]} {v:.4g}" for k, v in scalars.items() if k != "train/loss")
            print(f"step {step}{of}  loss {scalars['train/loss']:.4f}  {extra}  ({rate:.2f} steps/s)",
                  file=self.stream, flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
