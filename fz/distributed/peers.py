"""Bounded waits and lost ranks: no collective fz waits for outlives `Spec.timeout_s`.

Every wait on a collective (fz/sharding/settle.py) goes through `wait_work`, with the
timeout of the last `fz.init` (gloo's own timeout applies too when fz starts the group).
A wait that fails (gloo's "Connection reset by peer", a timeout) becomes an `fz.PeerError`
naming what this rank was doing (`doing`: "fz.train_step at step 12") and the lost ranks.

Lost ranks are told by a heartbeat: a daemon thread of each process adds 1 to its counter
in the job's store (torchrun's, or the group's TCPStore) every `BEAT` seconds and
publishes what the rank is doing. On a failure the survivor reads every counter twice,
`PROBE` seconds apart: a rank whose counter did not move is lost (killed, stopped by
SIGSTOP, or its whole process hung), unless it said it left after losing a peer itself, or
it finished its script: a process that exits says so (`EXITED`) and is never called lost.
A store that does not answer names its host (rank 0 unless torchrun's agent hosts it): every
store call has a deadline (fz/distributed/storecall.py). A step that raises in the middle of
its collectives (`broke`) makes every later fz call of the process raise (`doing` checks). Nothing here
runs on a step's path but a string assignment; the thread costs two store messages a beat.
"""
from __future__ import annotations

import atexit
import contextlib
import re
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Protocol

import torch.distributed as dist

from fz.distributed import guards
from fz.distributed.storecall import STORE_S, StoreDown, call, store_host, within
from fz.errors import PeerError

BEAT = 0.5  # s between heartbeats
PROBE = 2.5  # s a survivor watches the counters for
_timeout_s = 300.0
_doing: tuple[str, int | None] = ("fz", None)  # (what this rank is doing, its step)
_waiting_since: float | None = None  # monotonic time this rank started waiting on a collective
_beat: _Heartbeat | None = None
_lock = threading.Lock()
failed = False  # a PeerError was raised in this process: exit does not wait for collectives
_first: PeerError | None = None  # that error: later failures repeat it without probing again
_broken: str | None = None  # a step raised in the middle of its collectives: this process's state is unusable
EXITED = "finished its script"  # what a rank publishes as it exits or ends its group (arrival checks it too)


def timeout_s() -> float:
    return _timeout_s


def doing(what: str, step: int | None = None) -> None:
    """Record what this rank is doing (named by PeerErrors here and on the other ranks). Every
    collective fz call starts here: after a step failed mid-collective it raises instead."""
    global _doing
    if _broken is not None:
        raise PeerError(f"{what}: {_broken}", (), step)
    _doing = (what, step)


FAILED_MID = "failed in the middle of its collectives"


def broke(what: str, err: BaseException) -> None:
    """`what` raised `err` out of its collectives (world > 1): the ranks' collectives no longer
    match, so every later fz call raises (a new collective would meet another rank's old one:
    gloo aborts the process on that mismatch) and exit does not wait for what is in flight."""
    global _broken, _doing, failed
    if (isinstance(err, PeerError) or getattr(err, "agreed", False) or _broken is not None
            or not dist.is_initialized() or dist.get_world_size() == 1):
        return  # (`agreed`: an error every rank raises together, after the exchange that found it)
    failed = True
    said = f"{activity()} {FAILED_MID} ({type(err).__name__}: {str(err)[:160]})"
    _broken = (f"this process's state is unusable after a failed step: {said}, so the ranks' collectives no "
               "longer match and no fz call can go on. End the job and restart it from the last checkpoint "
               "(fz.restore); catching an exception of a step and going on is not possible")
    _doing = (said, None)


def activity() -> str:
    what, step = _doing
    return what if step is None else f"{what} at step {step}"


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


class _Heartbeat(threading.Thread):
    def __init__(self, store: dist.Store, rank: int):
        super().__init__(name="fz-heartbeat", daemon=True)
        # a connection of its own: a group starting on `store` blocks its connection in long waits
        self.source, self.store = store, within(store.clone, STORE_S) or store  # type: ignore[attr-defined]  # no stub
        self.rank, self.stop = rank, threading.Event()
        self.own = False  # started by fz's group start-up (on the store it made), not on the default group's

    def run(self) -> None:
        while not self.stop.is_set():
            since = _waiting_since
            waiting = "" if since is None else f" (waiting for other ranks for {time.monotonic() - since:.0f} s)"
            try:
                call(lambda: self._beat(activity() + waiting))  # noqa: B023 - called before the loop goes on
            except StoreDown as e:
                if not e.timed_out:  # the store is gone (its host exited): nothing left to tell
                    return
                # slow or frozen: beat again (a busy store host must not make this rank look lost)
            self.stop.wait(BEAT)

    def _beat(self, said: str) -> None:
        self.store.add(f"fz/hb/{self.rank}", 1)
        self.store.set(f"fz/doing/{self.rank}", said)


def stop_heartbeat(timeout: float = 2.0) -> None:
    """Stop and join the heartbeat thread: at exit and before the group (its store) is destroyed,
    so no thread is inside a store call while the interpreter or the store goes away (that
    aborts the process: "terminate called without an active exception")."""
    global _beat
    with _lock:
        beat, _beat = _beat, None
    if beat is not None and beat.is_alive():
        beat.stop.set()
        beat.join(timeout)


def configure(timeout: float) -> None:
    """Set the wait bound (Spec.timeout_s) and start this process's heartbeat (world > 1) on the
    default group's store, unless fz started the group and its heartbeat already runs."""
    global _timeout_s
    _timeout_s = float(timeout)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    beat = _beat
    store = _store()
    if store is not None and not (beat is not None and beat.own and beat.is_alive()):
        start_heartbeat(store, dist.get_rank())


def start_heartbeat(store: dist.Store, rank: int, own: bool = False) -> None:
    """Beat on `store` from now on (`own`: the store fz started the group on, before the group
    exists: fz/distributed/startup.py; it stays the heartbeat's for that group)."""
    global _beat
    with _lock:
        if _beat is not None and _beat.source is store and _beat.is_alive():
            return
        if _beat is not None:
            _beat.stop.set()
        _beat = _Heartbeat(store, rank)
        _beat.own = own
        within(lambda: store.delete_key(f"fz/exited/{rank}"), PROBE)  # a group started again: not done
        _beat.start()
    _install_stop()


_stop_installed = False


def _install_stop() -> None:
    """When the first heartbeat starts, not at import: it stops at exit and before the default
    group (whose store it talks to) is destroyed."""
    global _stop_installed
    if not _stop_installed:
        _stop_installed = True
        atexit.register(_finish, "")
        guards.before_destroy(lambda: _finish(" (destroy_process_group)"), order=1)


def _finish(how: str) -> None:
    """Stop the heartbeat, then tell the others this rank is done (a rank still waiting for it in
    a collective says so, not "lost"); an uncaught exception is named as what ended it."""
    beat = _beat
    stop_heartbeat()
    if beat is None:
        return
    err = getattr(sys, "last_value", None)
    said = EXITED + how + ("" if err is None else f"{_CRASHED}{type(err).__name__}: {str(err)[:160]})")

    def tell() -> None:
        beat.store.set(f"fz/doing/{beat.rank}", said)
        beat.store.set(f"fz/exited/{beat.rank}", "1")

    within(tell, 1.0)


def lost_error(what: str, lost: Sequence[int]) -> PeerError:
    """The PeerError for ranks seen lost outside a collective (arrival's check-in)."""
    global failed, _first
    failed = True
    _first = PeerError(f"{what}: lost rank(s) {list(lost)}: no heartbeat for {PROBE:.1f} s (killed, stopped or hung)",
                       tuple(lost), _doing[1])
    return _first


_CRASHED = " after an error ("  # what an uncaught exception adds to a rank's EXITED


def crash_of(said: str) -> str | None:
    """The error that ended a rank's script ("RuntimeError: ..."), read from what it published as
    it exited; None if its script ended without one."""
    if not said.startswith(EXITED) or _CRASHED not in said:
        return None
    return said.split(_CRASHED, 1)[1].removesuffix(")")


def crash_error(what: str, crashed: dict[int, str]) -> PeerError:
    """The PeerError for ranks whose script ended with an uncaught exception ({rank: its error})."""
    global failed, _first
    failed = True
    errors = "; ".join(f"rank {r}: {e}" for r, e in sorted(crashed.items()))
    _first = PeerError(f"{what}: rank(s) {sorted(crashed)} crashed ({errors}); its output has the traceback. The "
                       "job cannot go on without it: fix that error, then restart from the last checkpoint",
                       tuple(sorted(crashed)), _doing[1])
    return _first


def store_lost(what: str, err: BaseException, step: int | None = None) -> PeerError:
    """A store call that failed or froze as the PeerError naming the store's host."""
    global failed, _first
    host, ranks = store_host()
    me = dist.get_rank() if dist.is_initialized() else -1
    ranks = tuple(r for r in ranks if r != me)
    failed = True
    _first = PeerError(f"{what}: the job's store, hosted by {host}, does not answer ({err}): lost rank(s) "
                       f"{list(ranks)} (killed, stopped or hung; the store's host)" if ranks else
                       f"{what}: the job's store, hosted by {host}, does not answer ({err})", ranks, step)
    return _first


def probe(world: int) -> tuple[list[int] | None, dict[int, str]]:
    """(the ranks whose heartbeat stopped, or None if the store does not answer; each rank's
    published activity)."""
    beat = _beat
    if beat is None:
        return None, {}
    store, me = beat.store, beat.rank
    within(lambda: store.add(f"fz/left/{me}", 1), PROBE)

    def read() -> tuple[list[int], list[int]]:
        return ([store.add(f"fz/hb/{r}", 0) for r in range(world)],
                [store.add(f"fz/left/{r}", 0) + store.add(f"fz/exited/{r}", 0) for r in range(world)])

    first = within(read, PROBE)
    if first is None:
        return None, {}
    time.sleep(PROBE)
    second = within(read, PROBE)
    if second is None:
        return None, {}
    lost = [r for r in range(world) if r != me and first[0][r] == second[0][r] and not second[1][r]]

    def doings() -> dict[int, str]:
        keys = [f"fz/doing/{r}" for r in range(world)]
        return {r: store.get(k).decode() for r, k in enumerate(keys) if r != me and store.check([k])}

    return lost, within(doings, PROBE) or {}


def peer_error(err: BaseException, world: int | None = None) -> PeerError:
    """`err` (a failed or timed-out collective) as a PeerError naming the lost ranks and the step
    (`world`: the job's size, while its default group is still starting)."""
    global failed, _first
    if _first is not None or sys.is_finalizing():  # probed once already (or exiting: no threads now)
        return PeerError(str(_first or err), _first.ranks if _first else (), _first.step if _first else None)
    failed = True
    step = _doing[1]
    world = world or (dist.get_world_size() if dist.is_initialized() else 1)
    lost, doings = probe(world)
    if lost is None:
        down = StoreDown(f"no answer within {PROBE:g} s")
        return store_lost(f"{activity()}: a collective failed ({_cause(err)})", down, step)
    exited = sorted(r for r, d in doings.items() if d.startswith(EXITED))
    crashed = {r: c for r in exited if (c := crash_of(doings[r])) is not None}
    if crashed and not lost:
        return crash_error(f"{activity()}: a collective failed", crashed)
    limit = _limit(err)
    broken = sorted(r for r, d in doings.items() if FAILED_MID in d)
    same = sorted(r for r, d in doings.items() if d == activity())  # in this call still, not waiting: working
    if exited and not lost:
        who = (f"rank(s) {exited} {doings[exited[0]]} while this rank waited for them in a collective: every rank "
               "must call the same fz functions (a call under `if rank == 0:` runs on one rank only)")
    elif lost:
        who = f"lost rank(s) {lost}: no heartbeat for {PROBE:.1f} s (killed, stopped or hung)"
    elif broken:
        who = f"rank(s) {broken}: {doings[broken[0]]}; this job must restart from its last checkpoint"
    elif same and ("save" in activity() or "restore" in activity()):
        who = (f"rank(s) {same} did not finish writing or reading their part of the checkpoint within the limit "
               f"({limit:g} s; FZ_CKPT_TIMEOUT sets it for checkpoints): a slow or stuck disk or filesystem")
    elif same:
        who = f"rank(s) {same} did not finish their part of {activity()} within the limit ({limit:g} s)"
    else:
        others = "; ".join(f"rank {r}: {d}" for r, d in sorted(doings.items()))
        who = ("every rank still answers, so they are not in the same collective: every rank must call the "
               f"same fz functions in the same order ({others or 'no activity published'})")
    cause = _cause(err)
    fired = f"the limit that fired: {limit:g} s; " if _timed_out(err) else ""
    _first = PeerError(f"{activity()}: a collective failed: {who}. The underlying error: {cause}. "
                       f"({fired}Spec.timeout_s={_timeout_s:g} bounds every wait.)", lost or (), step)
    return _first


def _timed_out(err: BaseException) -> bool:
    return "timed out" in str(err).lower() or "timeout" in str(err).lower()


def _limit(err: BaseException) -> float:
    """The limit that fired: gloo's message says it ("Timed out waiting 20000ms"), else Spec.timeout_s."""
    m = re.search(r"(\d+)\s*ms\b", str(err))
    return int(m.group(1)) / 1000 if m else _timeout_s


def _cause(err: BaseException) -> str:
    """The backend's error in fz's words (gloo's is a source path, a socket and "GLHF!")."""
    text = str(err)
    if "reset by peer" in text or "Connection closed" in text or "Broken pipe" in text:
        return "a peer's connection closed (gloo: connection reset or closed by peer)"
    if "timed out" in text.lower():
        return f"no answer within {_limit(err):g} s ({text.splitlines()[0][-120:]})"
    return text.splitlines()[0][:300] if text else type(err).__name__


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Mark the main thread as waiting for other ranks (published by the heartbeat)."""
    global _waiting_since
    if threading.current_thread() is not threading.main_thread() or _waiting_since is not None:
        yield
        return
    _waiting_since = time.monotonic()
    try:
        yield
    finally:
        _waiting_since = None


_MARKERS = ("reset by peer", "Connection closed", "Broken pipe", "timed out", "Timed out")


def is_comm_failure(err: BaseException) -> bool:
    if isinstance(err, dist.DistError) or any(m in str(err) for m in _MARKERS):
        return True
    failures = getattr(err, "failures", None)  # DCP's CheckpointException: {rank: exception}
    if isinstance(failures, dict):
        return any(is_comm_failure(f[0] if isinstance(f, tuple) else f) for f in failures.values()
                   if isinstance(f, BaseException) or isinstance(f, tuple))
    return False


@contextlib.contextmanager
def translated() -> Iterator[None]:
    """Collectives fz does not wait for itself (DCP's): a lost peer is a PeerError there too."""
    try:
        yield
    except PeerError:
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if not is_comm_failure(e):
            raise
        raise peer_error(e) from e


class Waitable(Protocol):
    def wait(self, timeout: timedelta) -> bool: ...


def wait_work(work: dist.Work | Waitable, group_timeout: bool = False) -> None:
    """`work.wait()` within the timeout (a gloo work, or a shared-memory link's: fz/distributed/shm.py);
    a failure is a PeerError (probed once per process). `group_timeout`: within the process group's own
    timeout instead (a script's barrier, which may wait out a rank's long work, as under DeepSpeed)."""
    with waiting():
        try:
            if group_timeout and isinstance(work, dist.Work):
                work.wait()
            else:
                work.wait(timeout=timedelta(seconds=_timeout_s))
        except RuntimeError as e:  # gloo/NCCL errors (DistBackendError is one), timeouts
            raise peer_error(e) from e


def store_for(ranks: Sequence[int]) -> dist.Store | None:
    """The store the heartbeat uses, when `ranks` are several processes of a running job."""
    beat = _beat
    return beat.store if len(ranks) > 1 and beat is not None and beat.is_alive() else None


def heartbeat_store() -> dist.Store | None:
    """The store this process's heartbeat talks to (None before one starts): fz/distributed/beats.py."""
    beat = _beat
    return None if beat is None else beat.store
