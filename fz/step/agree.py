"""Ranks agree on the step, the batch size and the blocks called: checked on the loss all-reduce itself.

Besides the loss, the all-reduce carries one slot per rank for its state's step, its
batch rows and a checksum of the blocks its forwards called, in order (each rank fills its
own slots, so the sum hands every rank all of them). A rank that fell behind (it caught an
exception and carried on), a batch of another number of rows, or a rank that called other
blocks (an MoE expert only some ranks call: the ranks' per-block collectives then paired up
wrongly) is then an error on every rank at once, naming the ranks, without a collective of
its own; the all-reduce still runs while the optimizer does (the state the step took is then
unusable: it was donated). Rows, not elements: ranks whose batches are padded to different
lengths train as under DDP, each rank's mean loss counting equally. With
`Spec.weight_by_rows` unequal rows are allowed and each rank counts by its rows: its loss is
scaled by its rows before backward and the averaged gradients by ranks / total rows, so that
mode waits before the update. With `Spec.accumulate="sum"` the loss function weighs each
rank itself (transformers' Trainer divides by the step's label tokens on all ranks), so rows
are not compared. Two more slots per rank carry the non-finite check (fz/step/nonfinite.py):
the index + 1 of the first parameter whose reduced gradient shard holds a NaN or inf (0:
none), and whether the rank's own loss is non-finite.
"""
from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from fz.errors import ConfigError
from fz.sharding.settle import Handle
from fz.step.batches import batch_size

V = TypeVar("V", int, str)


def _by_value(values: list[V], ranks: list[int], unit: str) -> str:
    groups: dict[V, list[int]] = {}
    for r, v in zip(ranks, values):
        groups.setdefault(v, []).append(r)
    parts = []
    for v, rs in sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[0])):
        who = (
            f"rank {rs[0]}"
            if len(rs) == 1
            else f"ranks {', '.join(map(str, rs[:8]))}" + (", ..." if len(rs) > 8 else "")
        )
        parts.append(f"{who}: {unit} {v}")
    return "; ".join(parts)


_SLOTS = 5  # per rank: step, batch rows, blocks called, first bad gradient, bad loss


class Agreement:
    """One loss all-reduce with the step and batch-size slots of every rank of the mesh."""

    def __init__(self, plan, step: Tensor, batch: Any, weight_by_rows: bool, what: str = "fz.train_step",
                 accumulate: str = "mean"):
        self.plan, self.weight_by_rows, self.what, self.accumulate = plan, weight_by_rows, what, accumulate
        self.ranks = list(plan.ranks)
        self.n = len(self.ranks)
        self.step = int(step)
        self.rows, self.numel = batch_size(batch)
        if self.numel == 0:
            raise ConfigError(f"{what}: the batch is empty ({self.rows} rows and no elements): did this rank's data "
                              "run out?")
        self.vec: Tensor | None = None  # start()'s
        self.work: Handle | None = None
        self.result: tuple[Tensor, float] | None = None  # finish()'s, once it ran
        self.bad_grads: list[int] = []  # per rank: index + 1 of its first non-finite gradient (0: none)
        self.bad_losses: list[int] = []  # per rank: 1 if its loss is non-finite

    @property
    def loss_weight(self) -> float:
        """What this rank's loss is multiplied by before backward."""
        return float(self.rows) if self.weight_by_rows and self.n > 1 else 1.0

    def start(self, comm, loss: Tensor, first_bad: Tensor | None = None,
              calls: Sequence[int] = ()) -> Agreement:
        """Launch the all-reduce of (this rank's loss, its slots); `loss` is its mean loss,
        `first_bad` the index + 1 of its first non-finite gradient (a 0-d tensor, 0: none),
        `calls` the blocks its forwards called, in order."""
        n = self.n
        slots = [0.0] * (_SLOTS * n)
        i = self.ranks.index(self.plan.rank)
        called = zlib.crc32(",".join(map(str, calls)).encode()) if n > 1 else 0  # < 2**32: exact in float64
        for k, v in enumerate((self.step, self.rows, called)):
            slots[k * n + i] = float(v)
        mine = (loss.detach().double() * self.loss_weight).reshape(1)
        self.vec = torch.cat([mine, torch.tensor(slots, dtype=torch.float64, device=loss.device)])
        if first_bad is not None:  # a tensor, written without waiting for its value
            self.vec[1 + 3 * n + i] = first_bad.double()
        self.vec[1 + 4 * n + i] = torch.logical_not(torch.isfinite(loss.detach())).double()
        if n > 1 and comm.world > 1:
            self.work = comm.all_reduce_sum(self.vec, async_op=True, scalar=True)
        return self

    def finish(self, comm) -> tuple[Tensor, float]:
        """(the mean loss over every rank, the factor for the averaged gradients); raises a
        ConfigError on every rank if the ranks' steps or (unless weighted) batch sizes differ.
        Calling it again returns the same result."""
        if self.result is None:
            try:
                self.result = self._finish(comm)
            except ConfigError as e:
                e.agreed = True  # type: ignore[attr-defined]  # every rank raises it: their collectives still match
                raise
        return self.result

    def _finish(self, comm) -> tuple[Tensor, float]:
        vec, n = self.vec, self.n
        if vec is None:
            raise RuntimeError("Agreement.finish() before start()")
        if n > 1:
            if self.work is not None:
                work, self.work = self.work, None
                work.wait()
            comm.replica_sum(vec, scalar=True)
        steps, rows, called, self.bad_grads, self.bad_losses = (
            vec[1 + k * n:1 + (k + 1) * n].long().tolist() for k in range(_SLOTS))
        if n == 1:
            return vec[0].float(), 1.0
        if len(set(steps)) > 1:
            raise ConfigError(
                f"{self.what}: the ranks are at different steps ({_by_value(steps, self.ranks, 'step')}): their "
                "collectives no longer pair up. Did a rank catch an exception and carry on? Every rank must "
                "call fz.train_step on the same state, step after step.")
        if len(set(called)) > 1:
            raise ConfigError(
                f"{self.what}: the ranks called different blocks, or in another order "
                f"({_by_value(called, self.ranks, 'call-order checksum')}), so their per-block collectives paired "
                "up wrongly and this step's result is wrong. Every rank must call the same blocks in the same "
                "order: route inside a block (an MoE layer as one block), or call every expert on every rank.")
        if self.weight_by_rows:
            total = sum(rows)
            return (vec[0] / total).float(), n / total
        if self.accumulate == "sum":  # the loss function weighed each rank
            return (vec[0] / n).float(), 1.0
        if len(set(rows)) > 1:
            raise ConfigError(
                f"{self.what}: the ranks' batches differ in rows ({_by_value(rows, self.ranks, 'rows')}): each "
                "rank's mean loss would count equally whatever its size. Give every rank the same rows per step, "
                "or set Spec(weight_by_rows=True) to weight each rank by its rows.")
        return (vec[0] / n).float(), 1.0
