"""Store calls with a deadline: a frozen store host (its process stopped) never answers.

The job's store is torchrun's agent's, or rank 0's when fz starts the group from MASTER_ADDR
and MASTER_PORT. A TCPStore call to a stopped host blocks without end (measured: 560 s with
Spec.timeout_s=20), so fz makes every store call through `call`, in a thread, with a deadline.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

STORE_S = 5.0  # s any store call may take: a store host that does not answer by then is frozen or gone
T = TypeVar("T")


class StoreDown(RuntimeError):
    """The job's store did not answer within STORE_S (`timed_out`), or failed: its host is frozen or gone."""

    timed_out = False


def call(fn: Callable[[], T], seconds: float = STORE_S) -> T:
    """fn() (a store call) within `seconds`, in a thread: a frozen store host (SIGSTOP) would
    block it forever. StoreDown if it does not return in time or raises (DistNetworkError...)."""
    box: list[tuple[bool, object]] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except Exception as e:  # noqa: BLE001 - re-raised as StoreDown below
            box.append((False, e))

    t = threading.Thread(target=run, daemon=True, name="fz-store-call")
    t.start()
    t.join(seconds)
    if not box:
        down = StoreDown(f"the job's store did not answer within {seconds:g} s")
        down.timed_out = True
        raise down
    ok, value = box[0]
    if not ok:
        raise StoreDown(f"the job's store failed ({type(value).__name__}: {str(value)[:200]})") from value  # type: ignore[misc]
    return value  # type: ignore[return-value]


def within(fn: Callable[[], T], seconds: float) -> T | None:
    """fn() in a thread, or None if it raises or does not return within `seconds` (a stopped
    store host): for what is told on the way out or read for a diagnosis, never waited on."""
    box: list[T | None] = []

    def run() -> None:
        try:
            box.append(fn())
        except Exception:  # noqa: BLE001 - an unreachable store is reported as such by the caller
            box.append(None)

    t = threading.Thread(target=run, daemon=True, name="fz-store-call")
    t.start()
    t.join(seconds)
    return box[0] if box else None


def store_host() -> tuple[str, tuple[int, ...]]:
    """Who hosts the job's store: torchrun's agent, or rank 0 (MASTER_ADDR/MASTER_PORT, env://)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return "the launcher (torchrun's agent)", ()
    return "rank 0", (0,)
