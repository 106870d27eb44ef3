"""The ZeRO stages as a table of DTensor placements, and the flat buckets built from it.

This file is where each stage's behaviour is decided; everything else follows from
the three placements a parameter gets:

| stage | param     | grad      | optimizer state |
|-------|-----------|-----------|-----------------|
| 0     | Replicate | Replicate | Replicate       |
| 1     | Replicate | Replicate | Shard(0)        |
| 2     | Replicate | Shard(0)  | Shard(0)        |
| 3     | Shard(0)  | Shard(0)  | Shard(0)        |

What follows from them:
- param Shard(0): gathered just in time per bucket (all-gather), freed after use.
- grad Replicate: gradients accumulate in full over micro-batches, reduced once per step;
  grad Shard(0): reduce-scattered after every micro-batch, only the shard is kept.
- optimizer Replicate: all-reduce, every rank updates the whole parameter;
  optimizer Shard(0): reduce-scatter, each rank updates its rows, and a replicated
  parameter is all-gathered back after the update.
Per-parameter override: at stage 3 a parameter under `persist_threshold` elements keeps
stage 2's placements (DeepSpeed's stage3_param_persistence_threshold); a 0-d one keeps
stage 0's in every stage (nothing to split, and DTensor has no Shard(0) of a scalar).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

R, S = Replicate(), Shard(0)


@dataclass(frozen=True)
class Placements:
    param: Placement
    grad: Placement
    opt: Placement


STAGES: dict[int, Placements] = {
    0: Placements(R, R, R),
    1: Placements(R, R, S),
    2: Placements(R, S, S),
    3: Placements(S, S, S),
}


def placements_for(stage: int, shape: torch.Size, persist_threshold: int) -> Placements:
    """The table's row for one parameter, after the per-parameter override."""
    if len(shape) == 0:
        return STAGES[0]  # a scalar (CLIP's logit_scale) cannot be split along dim 0: in every stage
    if stage == 3 and math.prod(shape) < persist_threshold:
        return STAGES[2]
    return STAGES[stage]
