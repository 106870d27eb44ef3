"""Residency plans: which units' gathered parameters stay alive across the forwards of one call.

`fz.apply` at stage 3 gathers each unit for its call and drops it after: right for training,
where a step runs one forward. Generation runs one forward per new token, so re-gathering every
unit for every token (what `generate()` does on a DeepSpeed ZeRO-3 engine) moves the whole model
per token. A `Residency` says which units keep their gathered parameters from their first
gather until the call ends:

- "gather": every unit ("gather once, decode many": one all-gather of the model per call);
- k (an int): the first k units in call order (the root counts as the first), the rest
  streamed per forward with prefetch, as `fz.apply` streams them;
- "stream": none (every forward gathers every unit, from host or disk if offloaded).

"auto" chooses from a memory budget the way `fz.plan` does (the budget less a 20% margin, the
largest plan that fits): by default the budget is what is free now on this rank's device (GPU
memory, or the host's available memory shared by the node's ranks), so what the state already
holds is counted by not being free; the plan needs the resident units' full parameters in the
compute dtype plus the working set of streaming (the widest streamed unit, once running and
`prefetch` times in flight). At stages 0-2 nothing is gathered
(every rank holds every parameter), so every plan is the same and there is nothing to choose.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fz.errors import ConfigError
from fz.log import logger
from fz.sharding.buckets import Bucket
from fz.sharding.comm import Comm
from fz.sharding.settle import Handle
from fz.state import State
from fz.step.runner import Runner, unit_buckets

MARGIN = 0.2  # fz.plan's default: the share of the budget kept free (allocator slack, activations)


@dataclass(frozen=True)
class Residency:
    """A chosen plan: `resident` units keep their gathered parameters for the whole call."""

    kind: str  # "gather", "partial", "stream" or "local" (stages 0-2: nothing to gather)
    resident: frozenset[int]  # unit indices (0: the root)
    units: int  # units with sharded parameters (what a forward gathers)
    gathered_bytes: int  # the resident units' full parameters, compute dtype
    budget: int | None  # bytes the plan was checked against (after the margin); None when forced
    why: str

    def describe(self, api: str) -> str:
        return f"{api}: residency {self.kind} ({self.why})"


def unit_order(order: Sequence[int], n_units: int) -> list[int]:
    """Units in call order: the root, those the last forward called, then any never called."""
    out = [0]
    for u in [*order, *range(n_units)]:
        if u not in out:
            out.append(u)
    return out


def unit_bytes(buckets_by_unit: Sequence[Sequence[Bucket]], dtype: torch.dtype) -> list[int]:
    """Each unit's gathered (sharded) parameters, whole, in `dtype`."""
    size = torch.empty((), dtype=dtype).element_size()
    return [sum(b.full_numel for b in ub if b.sharded_param) * size for ub in buckets_by_unit]


def free_bytes(device: torch.device) -> int:
    """What this rank may use now: free GPU memory, or the host's available memory shared by
    this node's ranks (LOCAL_WORLD_SIZE of them)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return avail // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def choose(state: State, want: str | int, order: Sequence[int], buckets_by_unit: Sequence[Sequence[Bucket]],
           prefetch: int, budget: float | None = None, api: str = "fz.generate") -> Residency:
    """The plan `want` asks for ("auto", "gather", "stream" or a unit count), for this state.
    `budget`: bytes this rank may add for gathered parameters (default: what is free now)."""
    sizes = unit_bytes(buckets_by_unit, state.spec.compute_dtype)
    calls = [u for u in unit_order(order, len(sizes)) if sizes[u]]
    if want not in ("auto", "gather", "stream") and not (isinstance(want, int) and not isinstance(want, bool)
                                                          and want >= 0):
        raise ConfigError(f"{api}: residency={want!r}: give 'auto' (chosen from the memory budget), 'gather' (the "
                          "whole model gathered once per call), 'stream' (every unit gathered per forward) or the "
                          "number of units to keep gathered (an int >= 0)")
    if not calls:
        return Residency("local", frozenset(), 0, 0, None, "stages 0-2: every rank holds every parameter")
    if want == "auto":
        room = int((free_bytes(state.plan.device) if budget is None else budget) * (1 - MARGIN))
        k = fit(sizes, calls, prefetch, room)
        return _plan(sizes, calls, k, room, f"chosen from {room / 2**20:.1f} MB usable")
    k = len(calls) if want == "gather" else 0 if want == "stream" else min(int(want), len(calls))
    return _plan(sizes, calls, k, None, "forced")


def fit(sizes: Sequence[int], calls: Sequence[int], prefetch: int, room: int) -> int:
    """The most units (a prefix of `calls`) whose gathered bytes, with the streaming working set of
    the rest, fit in `room`."""
    for k in range(len(calls), -1, -1):
        rest = [sizes[u] for u in calls[k:]]
        need = sum(sizes[u] for u in calls[:k]) + (min(len(rest), 1 + prefetch) * max(rest) if rest else 0)
        if need <= room:
            return k
    return 0


def _plan(sizes: Sequence[int], calls: Sequence[int], k: int, room: int | None, why: str) -> Residency:
    kind = "gather" if k == len(calls) else "stream" if k == 0 else "partial"
    held = sum(sizes[u] for u in calls[:k])
    what = {"gather": "the whole model gathered once per call",
            "stream": "every unit gathered per forward, with prefetch",
            "partial": f"the first {k} of {len(calls)} units kept gathered, the rest streamed per forward"}[kind]
    return Residency(kind, frozenset(calls[:k]), len(calls), held, room,
                     f"{what}; {held / 2**20:.1f} MB kept per rank; {why}")


class ResidentRunner(Runner):
    """A Runner that keeps the gathered parameters of `resident` units for its whole life (one
    call: many forwards) and prefetches only the units it does not hold. Every rank holds the
    same units (the plan depends only on the model and the budget agreed on: see `choose`), so
    the ranks' all-gathers still pair up."""

    def __init__(self, *args: Any, resident: frozenset[int] = frozenset(), **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.resident = resident
        self.held: dict[int, dict[str, Tensor]] = {}

    def _gathered(self, index: int) -> dict[str, Tensor]:
        if index not in self.resident:
            return super()._gathered(index)
        if index not in self.held:
            self.held[index] = super()._gathered(index)
        return self.held[index]

    def _prefetch_units(self, unit: int, direction: int, kind: str | None = None) -> None:
        """Forward prefetch (no backward runs here) of the next units not held."""
        order = self.order
        if not self.prefetch or unit not in order or direction < 0:
            return
        pos = order.index(unit)
        for k in range(1, self.prefetch + 2) if direction else (0,):
            j = pos + k if direction else pos
            if j >= len(order) or order[j] in self.held:
                continue
            for b in self.unit_buckets[order[j]]:
                if b.sharded_param and k <= self.prefetch:
                    self.gatherer.prefetch(b, self.leaves[b.index])
                elif b.sharded_param:
                    self.gatherer.read_ahead(b, self.leaves[b.index])

    def dispose(self) -> None:
        self.held = {}
        super().dispose()


def deciding(state: State, want: str | int, budget: float | None, api: str) -> Callable[[Comm], Residency]:
    """The plan for one call of `api`, decided once its ranks have checked in: with "auto" at stage 3
    the ranks of a shard group agree on the smallest budget (so all keep the same units and their
    all-gathers pair up). The plan is logged once per call, by the group's first rank."""
    sharded = any(b.sharded_param for b in state.plan.buckets)

    def decide(comm: Comm) -> Residency:
        room = budget
        if want == "auto" and sharded and comm.world > 1:
            mine = torch.tensor(float(free_bytes(state.plan.device) if budget is None else budget),
                                dtype=torch.float64, device=state.plan.device)
            # waited within Spec.timeout_s: a rank lost meanwhile is an fz.PeerError
            Handle([mine]).add(dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=comm.group, async_op=True)).wait()
            room = float(mine)
        chosen = choose(state, want, state.metrics["order"].tolist(), unit_buckets(state.skeleton, state.plan.buckets),
                        state.spec.prefetch, room, api)
        if comm.rank == 0:
            logger("residency").info("%s", chosen.describe(api))
        return chosen

    return decide
