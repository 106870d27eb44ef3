"""A collective is over only once gloo's worker thread has let go of its tensors, GIL-free.

In torch 2.13 a tensor that has a Python object keeps that object alive while C++ holds a
second reference to it: the reference that takes the count from 1 to 2 increfs the object
and the one that drops it back to 1 decrefs it, which takes the GIL (c10/util/intrusive_ptr.h).
gloo's worker thread drops its references a moment after the waiting thread wakes up; when
its drop is the 2 -> 1 one and the interpreter is finalizing by then (the collective was a
job's last), Python ends the thread with pthread_exit inside a noexcept destructor:
"terminate called without an active exception", exit status -6.

So every collective fz runs goes through a `Handle`: before the launch it takes one more C++
reference to each tensor (a ScriptList), so gloo's threads never make that last drop; `wait()`
returns once the works are done and the use counts are back to what they were at launch
(gloo has let go), and then drops the ScriptList here, in a thread that holds the GIL. A
handle dropped while its collective is in flight keeps itself alive until it completes (or
exit, which waits for it). Every wait is bounded by Spec.timeout_s, and a failed one is an
fz.PeerError (fz/distributed/peers.py); after one, exit no longer waits for what is in flight.
"""
from __future__ import annotations

import atexit
import os
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from fz.distributed import peers
from fz.distributed.shm import LinkWork

_RELEASE_TIMEOUT = 2.0  # s: past this, someone besides gloo holds the tensor; stop waiting
_orphans: list[Handle] = []


class Handle:
    """One collective (or several launched together): its works and the tensors they use."""

    def __init__(self, tensors: Sequence[Tensor], then: Callable[[], None] | None = None):
        self.tensors = list(tensors)
        self.keeper = torch._C.ScriptList(self.tensors) if self.tensors else None  # C++ references
        # with the keeper's, before the launch
        self.counts = [t._use_count() for t in self.tensors]  # type: ignore[attr-defined]  # torch: private, no stub
        self.works: list = []
        self.then = then

    def add(self, work: dist.Work | LinkWork | None) -> Handle:
        if work is not None:
            self.works.append(work)
        return self

    @property
    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def __del__(self) -> None:
        try:
            if self.works and not peers.failed:  # in flight: live on (resurrected) until it completes, or exit
                for h in [h for h in _orphans if h.done]:
                    _orphans.remove(h)
                    h.wait()
                _orphans.append(self)
                _register_settle()
        except Exception:  # noqa: BLE001 - interpreter teardown: nothing left to keep it in
            pass

    def wait(self) -> bool:
        works, self.works = self.works, []
        while works:
            peers.wait_work(works.pop(0))  # no reference to a finished work is kept: it holds the tensors
        _released(self.tensors, self.counts)
        self.tensors, self.counts, self.keeper = [], [], None  # the keeper's drops happen here
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True


def _released(tensors: Sequence[Tensor], counts: Sequence[int]) -> None:
    deadline = None
    for t, n in zip(tensors, counts):
        while t._use_count() > n:  # type: ignore[attr-defined]  # torch: private, no stub
            if deadline is None:
                deadline = time.monotonic() + _RELEASE_TIMEOUT
            elif time.monotonic() > deadline:
                return
            os.sched_yield()


def _settle_at_exit() -> None:
    """Before the interpreter finalizes: finish what is in flight, then let go of the GIL for a
    moment, so a gloo worker releasing a collective fz does not own (DCP's, the user's) can
    take it (measured: one GIL release after a job's last collective ends these aborts)."""
    while _orphans and not peers.failed:  # after a PeerError, what is in flight never ends
        try:
            _orphans.pop().wait()
        except Exception:  # noqa: BLE001 - a peer gone at exit: the work failed, its tensors are free
            pass
    time.sleep(0.01)


_settle_registered = False


def _register_settle() -> None:
    """At the first collective left in flight, not at import: settle it before exit."""
    global _settle_registered
    if not _settle_registered:
        _settle_registered = True
        atexit.register(_settle_at_exit)
