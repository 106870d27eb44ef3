"""Collective APIs called by one rank only fail fast: "every rank must call fz.save".

Before its collectives, a collective API (`fz.save`, `fz.restore`, `fz.full_params`,
`fz.load_weights`) checks in at the job's store: each rank adds its key for the n-th call
of that API, then waits until every rank of the state's mesh has. A rank that arrives
alone does not hang: it raises a ConfigError as soon as a missing rank is seen waiting in
a collective of something else (its heartbeat says so, fz/distributed/peers.py: the two ranks wait for
each other), and at the latest after Spec.timeout_s, naming the missing ranks and what
they are doing. Its key is taken back, so a later call on every rank pairs up again.
A missing rank whose heartbeat stops for PROBE seconds (killed, stopped) is a PeerError
naming it, within seconds, and so is one whose script ended with an uncaught exception
(naming that error: it crashed, it did not skip the call); a store that fails or does not
answer (its host, rank 0, died or froze) is a PeerError naming the host. Every store call
has a deadline (peers.call).
Where rank 0 hosts the store (env://, not torchrun's agent), rank 0 returns only once every
other rank has seen the check-in complete (each says so with one more key): a call with no
collective after it (`trainer.save_model()` at ZeRO 0-2 writes from rank 0's own copy) would
otherwise let rank 0 finish its script and take the store down while a peer polls it, failing
that peer at the very end of a good run.
Each rank takes back its keys of the call before last (every rank is past it), so the store
holds two calls' keys however long the job. A few store round trips per rank and call; nothing
on a training step's path.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

import torch.distributed as dist

from fz.distributed import beats, peers
from fz.distributed.storecall import store_host
from fz.errors import ConfigError, PeerError

STUCK_S = 2.0  # a missing rank waiting this long in another collective will not come
_calls: Counter = Counter()  # (api, ranks) -> calls made by this rank


def arrive(api: str, ranks: Sequence[int], rank: int) -> None:
    """Return once every rank of `ranks` called `api` as often as this one; else ConfigError."""
    store = peers.store_for(ranks)
    if store is None:
        return
    ident = (api, tuple(ranks))
    _calls[ident] += 1
    prefix = f"fz/call/{api}/{min(ranks)}-{len(ranks)}"
    base = f"{prefix}/{_calls[ident]}"
    keys = [f"{base}/{r}" for r in ranks]
    try:
        peers.call(lambda: store.set(f"{base}/{rank}", "1"))  # stored as the bytes b"1"
        if _calls[ident] > 2:  # every rank is past the call before last (each checked in after it): its keys go
            old = f"{prefix}/{_calls[ident] - 2}"
            peers.call(lambda: (store.delete_key(f"{old}/{rank}"), store.delete_key(f"{old}/seen/{rank}")))
        with peers.waiting():
            _wait_for_all(store, api, ident, base, keys, ranks, rank)
            if rank != _HOST:
                peers.call(lambda: store.set(f"{base}/seen/{rank}", "1"))
            elif store_host()[1] == (_HOST,):
                _wait_for_readers(store, api, [f"{base}/seen/{r}" for r in ranks if r != rank], ranks)
    except peers.StoreDown as e:
        raise peers.store_lost(f"{peers.activity()}: checking in for {api}", e) from e


_HOST = 0  # the rank whose process hosts the store, unless torchrun's agent does


def _wait_for_readers(store: dist.Store, api: str, seen: list[str], ranks: Sequence[int]) -> None:
    """Wait until every other rank has seen the check-in complete (they are past their last
    store read of it); a rank that dies before saying so is a PeerError."""
    deadline, watched = time.monotonic() + peers.timeout_s(), {}  # type: ignore[var-annotated]
    others = [r for r in ranks if r != _HOST]
    while not _poll(store, seen, 0.5):
        missing = [r for r, k in zip(others, seen) if not peers.call(lambda k=k: store.check([k]))]  # type: ignore[misc]
        lost = beats.stopped(missing, watched)
        if lost:
            raise peers.lost_error(f"{peers.activity()}: {api}: rank(s) {lost} checked in, then", lost)
        if time.monotonic() > deadline:  # alive, but not past a check-in every rank had made: its store is slow
            raise PeerError(f"{peers.activity()}: {api}: rank(s) {missing} checked in but did not see every rank "
                            f"had within Spec.timeout_s={peers.timeout_s():g} s", tuple(missing))


def _poll(store: dist.Store, keys: list[str], seconds: float) -> bool:
    """Whether every key exists within `seconds` (checked every few ms)."""
    end = time.monotonic() + seconds
    while not peers.call(lambda: store.check(keys)):
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def _wait_for_all(store: dist.Store, api: str, ident: tuple[str, tuple[int, ...]], base: str, keys: list[str],
                  ranks: Sequence[int], rank: int) -> None:
    deadline = time.monotonic() + peers.timeout_s()
    seen: dict[int, tuple[int, float]] = {}
    while True:
        if _poll(store, keys, 0.5):  # polled, not store.wait: its timeouts log a C++ warning each
            return
        missing = [r for r, k in zip(ranks, keys) if not peers.call(lambda k=k: store.check([k]))]  # type: ignore[misc]
        if not missing:
            return
        doings = beats.published(missing)
        lost = [r for r in beats.stopped(missing, seen) if not doings.get(r, "").startswith(peers.EXITED)]
        if lost:
            _calls[ident] -= 1
            raise peers.lost_error(f"{peers.activity()}: {api} waited for rank(s) {lost} to call it too", lost)
        crashed = {r: c for r in missing if (c := peers.crash_of(doings.get(r, ""))) is not None}
        if crashed:  # it did not skip the call: its script died of an error (no advice about `if rank == 0:`)
            _calls[ident] -= 1
            raise peers.crash_error(f"{peers.activity()}: {api} waited for the other ranks to call it too", crashed)
        stuck = {r: d for r, d in doings.items() if beats.stuck_for(d) >= STUCK_S}
        exited = {r: d for r, d in doings.items() if d.startswith(peers.EXITED)}
        if stuck or exited or time.monotonic() > deadline:
            peers.call(lambda: store.delete_key(f"{base}/{rank}"))
            _calls[ident] -= 1
            shown = "; ".join(f"rank {r}: {doings.get(r, 'no activity published')}" for r in missing)
            why = ("are waiting for the others elsewhere" if stuck else "finished their script without calling it"
                   if exited else f"did not call it within Spec.timeout_s={peers.timeout_s():g} s")
            raise ConfigError(
                f"{api}: every rank must call {api} (it is collective), but rank(s) {missing} {why} ({shown}). "
                f"Call {api} on every rank, not under `if rank == 0:`; to print on one rank, call it on every "
                "rank and print under the `if`.")
