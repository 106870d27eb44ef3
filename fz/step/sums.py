"""`sum_over_ranks`: a count summed over every rank of a state's mesh, before a step needs it.

A loss normalized over the whole step (transformers' Trainer divides by the label tokens of
every micro-batch on every rank, `num_items_in_batch`) needs that count before the first
forward. This is its all-reduce: within the shard group, then across replica groups, on gloo's own
connections (the shared-memory link may still carry the last step's parameter gathers, which
the next forward overlaps: a count queued behind them would wait for all of them), each wait
bounded by Spec.timeout_s, a lost rank an fz.PeerError (fz/sharding/settle.py). Every rank
calls it, as it calls train_step; it reads nothing of the state but its mesh.
"""
from __future__ import annotations

import torch
from torch import Tensor

from fz.distributed import peers
from fz.sharding.comm import Comm
from fz.state import State, expect_state


def sum_over_ranks(state: State, value: int | float | Tensor) -> Tensor:
    """`value` (a number or a tensor) summed over every rank of `state`'s mesh; a new tensor on
    the state's device, int64 for integers (summed in float64: exact below 2**53), else float64."""
    expect_state(state, "fz.sum_over_ranks")
    given = torch.as_tensor(value)
    t = given.to(state.plan.device, torch.float64, copy=True)
    if len(state.plan.ranks) > 1:
        peers.doing("fz.sum_over_ranks", int(state.step))
        Comm(state.plan).sum_now(t)  # not behind the last step's parameter gathers, which the forward overlaps
    return t if given.is_floating_point() else t.round().to(torch.int64)
