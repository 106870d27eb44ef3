"""`comm_report`: what the last train_step sent, per collective kind, on this rank.

Payload is the size of the collective's full buffer (all-reduce: the tensor; reduce-
scatter: its input; all-gather: its output). Sent per rank is what a ring algorithm
moves for it: 2(N-1)/N of the payload for an all-reduce, (N-1)/N for the others.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from fz.state import State

_RING = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "scalar": 2.0}


@dataclass(frozen=True)
class CommReport:
    world: int
    payload: Dict[str, int]  # kind -> bytes of the collectives' buffers in the last step

    @property
    def sent(self) -> Dict[str, float]:
        n = self.world
        return {k: v * _RING.get(k, 1.0) * (n - 1) / n for k, v in self.payload.items()}

    @property
    def sent_total(self) -> float:
        """Bytes this rank sent for model-sized collectives (losses and norms excluded)."""
        return sum(v for k, v in self.sent.items() if k != "scalar")

    def __str__(self) -> str:
        lines = [f"fz communication, last step, world {self.world}: kind, payload MiB, sent per rank MiB"]
        for k, v in sorted(self.payload.items()):
            lines.append(f"  {k:15} {v / 2**20:10.3f} {self.sent[k] / 2**20:10.3f}")
        return "\n".join(lines)


def comm_report(state: State) -> CommReport:
    return CommReport(state.plan.world, dict(state.plan.last_step_bytes))
