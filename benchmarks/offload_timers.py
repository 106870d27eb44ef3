"""The per-step time split of benchmarks/offload.py's workers: fz's disk I/O, optimizer update,
parameter loads, hashing and collectives wrapped to add their wall time (and bytes) to a dict of
totals, and the process's CPU time and page faults. Functions an older fz lacks (--baseline) are
left alone."""
from __future__ import annotations

import threading
import time

_TOTALS_LOCK = threading.Lock()
_DEPTH = threading.local()  # per thread: inside a wrapped collective (its own Handle.wait is not counted again)


def _add(totals: dict, key: str, value: float) -> None:
    with _TOTALS_LOCK:
        totals[key] = totals.get(key, 0.0) + value


def _timed(obj, name: str, totals: dict, key=None, nbytes=None, comm: bool = False) -> None:
    """Wrap obj.name to add its wall time to totals[name] (the time split of a step; I/O threads too).

    `key(*args)` picks the totals key per call (default `name`); `nbytes(*args)` adds bytes to
    totals[key + "_bytes"]; `comm` marks a collective: Handle.wait inside it is not counted apart."""
    fn = getattr(obj, name, None)
    if fn is None:  # an older fz (--baseline) without it
        return

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        if comm:
            _DEPTH.n = getattr(_DEPTH, "n", 0) + 1
        try:
            return fn(*a, **k)
        finally:
            if comm:
                _DEPTH.n -= 1
            what = key(*a, **k) if key else name
            _add(totals, what, time.perf_counter() - t0)
            if nbytes:
                _add(totals, what + "_bytes", nbytes(*a, **k))
    setattr(obj, name, wrapper)


# Comm's methods that run collectives. "comm" is the wall time of these calls (a sync call includes
# its wait); async ones return a Handle, waited on later: "comm_wait" is the time in Handle.wait
# outside a wrapped call (any Handle, whoever waits; it includes the pairwise reduce-scatter's sum,
# run by the wait). Time a collective's data spends in flight while the step computes is in neither.
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_reduce_sum", "replica_mean", "replica_sum",
               "broadcast_first")


def instrument(totals: dict) -> None:
    """The step's time split: disk I/O, optimizer update, parameter loads, hashing, collectives."""
    import fz.step.updaters as updaters
    import fz.storage.disk as disk
    try:
        import fz.storage.checksum as checksum
    except ImportError:  # before the hashes existed
        checksum = None
    _timed(updaters, "disk_update", totals)
    _timed(disk.DiskTensor, "load", totals)
    if hasattr(checksum, "_hash"):  # the block hashes of fz/storage/checksum.py, in every I/O thread
        _timed(checksum, "_hash", totals)
    try:
        import fz.storage.io as io
        # the tier's pool reads/writes (optimizer state; the I/O threads): wall time and bytes
        _timed(io.IOPool, "_io", totals, key=lambda self, blob, off, buf, write: "pool_write" if write else "pool_read",
               nbytes=lambda self, blob, off, buf, write: buf.numel() * buf.element_size())
    except ImportError:
        pass
    # every disk read/write (pool + parameter loads/stores), the pread/pwrite and its checksum
    if hasattr(disk.Blob, "io"):
        _timed(disk.Blob, "io", totals, key=lambda self, fd, view, off, write: "io_write" if write else "io_read",
               nbytes=lambda self, fd, view, off, write: len(view))
    from fz.sharding import comm
    for name in COLLECTIVES:
        _timed(comm.Comm, name, totals, key=lambda *a, **k: "comm", comm=True)
    try:
        from fz.sharding import settle
    except ImportError:
        return
    wait = getattr(settle.Handle, "wait", None)
    if wait is None:
        return

    def timed_wait(self, *a, **k):  # an async collective's wait (also its `then`: the pairwise sum)
        if getattr(_DEPTH, "n", 0):
            return wait(self, *a, **k)
        t0 = time.perf_counter()
        try:
            return wait(self, *a, **k)
        finally:
            _add(totals, "comm_wait", time.perf_counter() - t0)
    settle.Handle.wait = timed_wait


def usage() -> dict:
    """This process's CPU (all threads), page faults, and the main thread's CPU time."""
    import resource
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"user": r.ru_utime, "kernel": r.ru_stime, "minflt": r.ru_minflt, "majflt": r.ru_majflt,
            "compute": time.thread_time()}
