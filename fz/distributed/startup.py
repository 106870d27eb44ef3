"""Starting process groups within Spec.timeout_s: a rank that never comes, dies or freezes while
a group starts is an fz.PeerError naming it, not torch's rendezvous waiting without end.

torch's env:// rendezvous waits for a frozen store host without a bound (seen: 150 s and more
with Spec.timeout_s=20), and its store's host raises a raw DistNetworkError for a rank that
never connects. So when fz starts the default group itself (`fz.init`, `fz.distributed.init()`
from torchrun's or the user's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT):

1. `open_store`: the job's store (rank 0 hosts it, or torchrun's agent) is joined within the
   timeout, else the error names its host;
2. `check_in`: each rank starts its heartbeat on that store (fz/distributed/peers.py) and
   checks in; ranks still missing after the timeout are named ("did not join the job");
3. `watched`: `init_process_group` runs on that store in a thread while this one watches the
   others' heartbeats: a rank that dies or freezes is named within PROBE seconds, a store host
   that stops answering within STORE_S, and past the timeout nothing waits on.

`watched` bounds the groups fz creates later too (a 2-D mesh's, the checkpoints'). A group the
user or another library started is theirs: fz's waits bound every collective on it, not its
start-up.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from fz.distributed import beats, peers
from fz.distributed.storecall import StoreDown, call
from fz.errors import PeerError

T = TypeVar("T")
_POLL = 0.1  # s between looks at the check-in count
_SAY_WAITING_S = 10.0  # s of waiting for the other ranks before it is said (once)
log = logging.getLogger(__name__)
_starts = 0  # default groups this process started: each start checks in under keys of its own


def start(backend: str, world: int, timeout: timedelta | None) -> None:
    """The default group of `world` processes, from the environment, within `timeout` (else the
    last Spec.timeout_s) at every step; `timeout` is also the group's own (gloo's)."""
    rank = int(os.environ["RANK"])
    limit = timeout.total_seconds() if timeout is not None else peers.timeout_s()
    store = open_store(world, rank, timedelta(seconds=limit))
    if world == 1:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        return
    check_in(store, rank, world, limit)
    watched("starting the process group", lambda: dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timeout), range(world), rank, limit)


def open_store(world: int, rank: int, timeout: timedelta) -> dist.Store:
    """The job's store at MASTER_ADDR:MASTER_PORT: rank 0 hosts it, unless torchrun's agent does.

    Under torchrun's agent the keys of this restart attempt get a prefix of their own: torchrun
    (2.13) keeps one store across `--max-restarts` attempts and does not prefix them, so a
    restarted rank could read a dead process's gloo address and fail to connect (seen in 1 run
    in 3); TORCHELASTIC_RESTART_COUNT keeps the attempts apart."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if rank == 0 and not agent:  # this rank hosts it: nothing to wait for (an error here is this host's own)
        return dist.TCPStore(host, port, world, is_master=True, timeout=timeout, wait_for_workers=False,
                             multi_tenant=True)
    try:  # in a thread: a frozen host accepts the connection and never answers
        store = call(lambda: dist.TCPStore(host, port, world, is_master=False, timeout=timeout,
                                           wait_for_workers=False), timeout.total_seconds() + 1)
    except StoreDown as e:
        raise peers.store_lost(f"{peers.activity()}: joining the job's store at {host}:{port} (MASTER_ADDR, "
                               "MASTER_PORT)", e) from e
    if agent:
        return dist.PrefixStore(f"fz/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    return store


def check_in(store: dist.Store, rank: int, world: int, limit: float) -> None:
    """Beat on `store` from now on and wait until all `world` ranks have checked in (`limit` s)."""
    global _starts
    _starts += 1
    peers.start_heartbeat(store, rank, own=True)  # from here on a rank that dies or freezes is seen
    base = f"fz/joined/{_starts}"
    deadline = time.monotonic() + limit
    try:
        call(lambda: store.set(f"{base}/{rank}", "1"))
        arrived = call(lambda: store.add(base, 1))
        said = False
        with peers.waiting():
            while arrived < world:
                late = time.monotonic() > deadline
                if late or (not said and time.monotonic() > deadline - limit + min(_SAY_WAITING_S, limit / 2)):
                    keys = [f"{base}/{r}" for r in range(world)]
                    missing = [r for r, k in enumerate(keys) if not call(lambda k=k: store.check([k]))]  # type: ignore[misc]
                    if late:
                        raise PeerError(
                            f"{peers.activity()}: rank(s) {missing} did not join the job within {limit:g} s "
                            "(Spec.timeout_s, or fz.distributed.init's timeout): not started, or killed, stopped or "
                            f"hung before joining (all {world} processes of WORLD_SIZE must start and call fz.init)",
                            missing)
                    said = True  # once, so that a job started by hand (no launcher) does not wait in silence
                    log.warning("fz: rank %d waits for rank(s) %s to join (WORLD_SIZE=%d; each process starts with "
                                "its own RANK: launch with `fz run` or torchrun), for up to %g s more", rank, missing,
                                world, max(deadline - time.monotonic(), 0))
                time.sleep(_POLL)
                arrived = call(lambda: store.add(base, 0))
    except StoreDown as e:
        raise peers.store_lost(f"{peers.activity()}: joining the job", e) from e


def watched(what: str, fn: Callable[[], T], ranks: Sequence[int], me: int, limit: float) -> T:
    """fn() (starting a group of `ranks`: it talks to the store and to them) in a thread, watched
    from here: a rank whose heartbeat stops is a PeerError within PROBE s, a store that does not
    answer one naming its host, and past `limit` s nothing waits on. fn's own failure to reach a
    rank (gloo's, the store's) is a PeerError too; any other error is raised as it is."""
    box: list[tuple[bool, object]] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            box.append((False, e))

    t = threading.Thread(target=run, daemon=True, name="fz-group-start")
    t.start()
    others = [r for r in ranks if r != me]
    seen: dict[int, tuple[int, float]] = {}
    deadline = time.monotonic() + limit
    with peers.waiting():
        while not box:
            t.join(0.25)
            if box:
                break
            try:
                lost = beats.stopped(others, seen)
                said = beats.published(others) if time.monotonic() > deadline else {}
            except StoreDown as e:
                raise peers.store_lost(f"{peers.activity()}: {what}", e) from e
            if lost:
                raise peers.lost_error(f"{peers.activity()}: {what}", lost)
            if time.monotonic() > deadline:
                shown = "; ".join(f"rank {r}: {d}" for r, d in sorted(said.items())) or "nothing published"
                raise PeerError(f"{peers.activity()}: {what} did not finish within Spec.timeout_s={limit:g} s, though "
                                f"every rank still beats ({shown})", (), None)
    ok, value = box[0]
    if ok:
        return value  # type: ignore[return-value]
    assert isinstance(value, BaseException)
    if isinstance(value, Exception) and peers.is_comm_failure(value):
        raise peers.peer_error(value, None if dist.is_initialized() else len(ranks)) from value
    raise value
