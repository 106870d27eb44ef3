"""`comm_report`: what the step that made a state sent, per collective kind, on this rank.

Payload is the size of the collective's full buffer (all-reduce: the tensor; reduce-
scatter: its input; all-gather: its output). Sent per rank is what a ring algorithm
moves for it: 2(N-1)/N of the payload for an all-reduce, (N-1)/N for the others, with N
the group it ran in: the shard group (ZeRO's collectives) or, on a 2-D mesh, the replica
groups ("inter_*": the only traffic that crosses groups). Read from `state.metrics`: local.

`h2d` and `d2h` are the step's copies between the host tier and the device, in bytes, by
kind: up, "forward" (offloaded parameter shards for the forward's gathers), "recompute"
(for backward's: gathered again, or recomputed under activation checkpointing) and "other"
(the host update's parameters going back to the device); down, "grads" (reduced gradients
leaving for the offloaded optimizer, per micro-batch, in the dtype they were reduced in) and
"other" (fp32 parameters the host update reads). Counted where fz issues each copy, from the
tiers the offload policy puts tensors in, so a CPU-only run reports what a GPU run moves.
Scalars (norms, flags) that meet the device for a collective are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fz.state import State

_RING = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "scalar": 2.0}


@dataclass(frozen=True)
class CommReport:
    world: int  # ranks in a shard group (ZeRO's N)
    payload: dict[str, int]  # kind -> bytes of the step's collectives within the shard group
    replicas: int = 1  # shard groups (2-D mesh); 1 on a 1-D mesh
    inter_payload: dict[str, int] = field(default_factory=dict)  # kind -> bytes across groups
    h2d: dict[str, int] = field(default_factory=dict)  # kind -> bytes host -> device ("forward", "recompute", "other")
    d2h: dict[str, int] = field(default_factory=dict)  # kind -> bytes device -> host ("grads", "other")

    @staticmethod
    def _sent(payload: dict[str, int], n: int) -> dict[str, float]:
        return {k: v * _RING.get(k, 1.0) * (n - 1) / n for k, v in payload.items()}

    @property
    def sent(self) -> dict[str, float]:
        return self._sent(self.payload, self.world)

    @property
    def inter_sent(self) -> dict[str, float]:
        return self._sent(self.inter_payload, self.replicas)

    @property
    def intra_sent_total(self) -> float:
        """Bytes this rank sent within its shard group for model-sized collectives."""
        return sum(v for k, v in self.sent.items() if k != "scalar")

    @property
    def inter_sent_total(self) -> float:
        """Bytes this rank sent across groups for model-sized collectives."""
        return sum(v for k, v in self.inter_sent.items() if k != "scalar")

    @property
    def sent_total(self) -> float:
        """Bytes this rank sent for model-sized collectives (losses and norms excluded)."""
        return self.intra_sent_total + self.inter_sent_total

    @property
    def h2d_total(self) -> int:
        """Bytes the step copied from the host tier to the device."""
        return sum(self.h2d.values())

    @property
    def d2h_total(self) -> int:
        """Bytes the step copied from the device to the host tier."""
        return sum(self.d2h.values())

    def __str__(self) -> str:
        lines = [f"fz communication, last step, shard group {self.world}, replicas {self.replicas}: "
                 "kind, payload MiB, sent per rank MiB"]
        for where, payload, sent in (
            ("intra", self.payload, self.sent),
            ("inter", self.inter_payload, self.inter_sent),
        ):
            for k, v in sorted(payload.items()):
                lines.append(f"  {where} {k:15} {v / 2**20:10.3f} {sent[k] / 2**20:10.3f}")
        if self.h2d or self.d2h:
            lines.append("host <-> device copies: kind, MiB")
            for where, moved in (("h2d", self.h2d), ("d2h", self.d2h)):
                for k, v in sorted(moved.items()):
                    lines.append(f"  {where} {k:15} {v / 2**20:10.3f}")
        return "\n".join(lines)


def comm_report(state: State) -> CommReport:
    """The bytes of every collective, and of every host <-> device copy, of the step that
    returned `state` (zeros for a fresh one)."""
    counts = {k: int(v) for k, v in state.metrics["comm"].items() if int(v)}
    intra = {k: v for k, v in counts.items() if not k.startswith("inter_")}
    inter = {k[len("inter_"):]: v for k, v in counts.items() if k.startswith("inter_")}
    moved = {k: int(v) for k, v in state.metrics.get("transfers", {}).items() if int(v)}
    h2d = {k[len("h2d_"):]: v for k, v in moved.items() if k.startswith("h2d_")}
    d2h = {k[len("d2h_"):]: v for k, v in moved.items() if k.startswith("d2h_")}
    return CommReport(state.plan.shards, intra, state.plan.replicas, inter, h2d, d2h)
