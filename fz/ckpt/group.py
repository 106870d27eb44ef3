"""The process group checkpoints talk over, and how ranks agree that a phase succeeded.

A separate gloo group (not the training group) lets an async save run its collectives in a
background thread while training runs its own: collectives from two threads on one group
could interleave differently on different ranks. For the same reason every Checkpointer
has its own group (two may have saves in flight at once). Its timeout (the state's
Spec.timeout_s; FZ_CKPT_TIMEOUT seconds overrides it) bounds how long a rank waits for a peer that died.
"""
from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from fz.compat import all_gather_single
from fz.distributed.startup import watched
from fz.errors import CheckpointError, ConfigError
from fz.sharding.settle import Handle
from fz.state import State


def state_ranks(state: State) -> tuple[int, ...]:
    """The global ranks holding `state`: the only thing checkpoints need from its plan."""
    return tuple(state.plan.ranks)


class GroupCache:
    """Checkpoint groups by ranks, each created once (collectively, by those ranks) on first use.

    A group belongs to the default group it was created under: after the default group is
    destroyed and initialized again, `get` creates a new one.
    """

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], tuple[Any, Any]] = {}

    def get(self, ranks: tuple[int, ...], timeout_s: float = 600.0):
        default = dist.distributed_c10d._get_default_group()
        hit = self._groups.get(ranks)
        if hit is not None and hit[0] is default:
            return hit[1]
        limit = float(os.environ.get("FZ_CKPT_TIMEOUT", timeout_s))
        g = watched("creating the checkpoint group", lambda: dist.new_group(  # a frozen store host: named
            list(ranks), backend="gloo", timeout=timedelta(seconds=limit), use_local_synchronization=True),
            ranks, dist.get_rank(), limit)
        self._groups[ranks] = (default, g)
        return g


def _message(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if not isinstance(err, ConfigError) else str(err)


def exchange(group, value: Any, err: BaseException | None, what: str) -> list[Any]:
    """All-gather `value` from every rank; if any rank reports an error, every rank raises.

    The rank that failed re-raises its own exception; the others raise a ConfigError
    naming that rank, so no rank is left waiting in a later collective.
    """
    world = dist.get_world_size(group)
    if world == 1:
        if err is not None:
            raise err
        return [value]
    payload = (value, None if err is None else (isinstance(err, ConfigError), _message(err)))
    out = _all_gather_json(group, world, payload)
    if err is not None:
        raise err
    for rank, (_, e) in enumerate(out):
        if e is not None:
            raise CheckpointError(f"{what} failed on rank {rank}: {e[1]}")
    return [v for v, _ in out]


def _all_gather_json(group, world: int, value: Any) -> list[Any]:
    """Every rank's JSON-able `value` (all_gather_object without pickle, and settled: see
    fz/sharding/settle.py; a save's last collective is often a job's last)."""
    mine = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    size = torch.tensor([mine.numel()], dtype=torch.int64)
    sizes = torch.empty(world, dtype=torch.int64)
    Handle([sizes, size]).add(all_gather_single(sizes, size, group=group, async_op=True)).wait()
    n = int(sizes.max())
    padded = torch.zeros(n, dtype=torch.uint8)
    padded[:mine.numel()] = mine
    out = torch.empty(world * n, dtype=torch.uint8)
    Handle([out, padded]).add(all_gather_single(out, padded, group=group, async_op=True)).wait()
    rows = out.view(world, n)
    return [json.loads(bytes(rows[r, :int(sizes[r])].numpy()).decode()) for r in range(world)]


def agree(group, err: BaseException | None, what: str) -> None:
    exchange(group, None, err, what)


def run_local(fn, *args: Any) -> tuple[Any, BaseException | None]:
    """(fn(*args), None), or (None, the exception) for `exchange` to share."""
    try:
        return fn(*args), None
    except Exception as e:  # noqa: BLE001 - shared with the other ranks, then re-raised
        return None, e


def dcp_error(err: CheckpointException, what: str, where, rank: int | None = None) -> BaseException:
    """DCP's CheckpointException (a BaseException) as a CheckpointError with each rank's cause; a
    Ctrl-C (or exit) DCP caught on this `rank` stays what it was, so that the caller's
    `except KeyboardInterrupt` and the exit status see it."""
    causes = []
    for r, failure in sorted(getattr(err, "failures", {}).items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, (KeyboardInterrupt, SystemExit)) and rank in (None, r):
            return exc
        causes.append(f"rank {r}: {type(exc).__name__}: {exc}")
    detail = "; ".join(causes) or str(err)
    return CheckpointError(f"{what} {where} failed: {detail}")
