"""Collectives between the ranks of one host through shared memory, not gloo's loopback TCP.

gloo moves every byte between two processes of one host through the kernel's TCP stack:
at the 2.5B NVMe headline its socket copies took 0.44x the ranks' user time
(benchmarks/RESULTS.md). Ranks that share a host map one buffer instead: each copies its
piece into its own slot, tells the others, and copies out (or sums) theirs, in user space.

A `Link` joins one group's ranks when they all see the same /dev/shm (checked when it opens
with a random token, so ranks of other hosts or containers keep gloo). Its buffer holds two
slots per rank, used in turn: a rank refills a slot only after every other rank has told it
the next chunk, which it does once it has read the slot. The signals go through one FIFO per
ordered pair of ranks, so the kernel orders the copies before them on every architecture,
every wait has a deadline (Spec.timeout_s), and a rank that exits closes its ends, which the
others see at once (a PeerError, like gloo's "connection reset"). Each signal names the
collective and its size: ranks in different collectives fail with both named, instead of
exchanging the wrong bytes. The files are unlinked once every rank has opened them.

Collectives run in order on the link's own thread (gloo's run on gloo's), so they overlap the
step as gloo's did; each returns a work waited for like gloo's (fz/sharding/settle.py). Sums add
the ranks' terms in rank order (`sum_in_rank_order`, which the pairwise exchange in
fz/sharding/comm.py uses too): the results are bit-identical to it, and the same on every rank.
"""
from __future__ import annotations

import atexit
import logging
import mmap
import os
import queue
import secrets
import select
import shutil
import struct
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from fz.distributed import peers
from fz.distributed.rows import Rows, check_sizes, fill, spans, sum_in_rank_order

SLOT_MAX = 4 << 20  # bytes a rank copies per chunk, at most (2-8 MiB measured alike): 2 slots per rank are mapped
_ALIGN = 64 << 10
_DIR = "/dev/shm"
_SIGNAL = struct.Struct("<IIQQ")  # collective kind, dtype, elements, chunk offset (< PIPE_BUF: one write)
_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8)
_GONE = "exited or failed"  # what a closed FIFO says of the rank at its other end
_links: dict[tuple[int, ...], tuple[weakref.ref, Link]] = {}
log = logging.getLogger(__name__)


class LinkWork:
    """A collective queued on a link: `wait` and `is_completed` as a gloo work's."""

    def __init__(self) -> None:
        self.finished = threading.Event()
        self.error: str | None = None  # a message only: no frame (with its tensors' views) outlives the work

    def is_completed(self) -> bool:
        return self.finished.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        limit = None if timeout is None else timeout.total_seconds()
        if not self.finished.wait(limit):
            raise RuntimeError(f"Timed out waiting {int((limit or 0) * 1000)}ms for a shared-memory collective")
        if self.error is not None:
            raise RuntimeError(self.error)
        return True


class Link:
    """One group's ranks on one host: `n` ranks, this one `me`, over a mapped buffer."""

    def __init__(self, n: int, me: int, buf: Tensor, slot: int, reads: dict[int, int], writes: dict[int, int],
                 where: str):
        self.n, self.me, self.buf, self.slot = n, me, buf, slot
        self.where = where  # the directory it was opened through (removed once opened)
        self.reads, self.writes = reads, writes  # peer -> FIFO fd (theirs to us, ours to them)
        self.seq = 0  # chunks exchanged: slot halves alternate
        self.broken: str | None = None  # why the link failed: every later collective fails with it
        self.closed = False
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="fz-shm-link", daemon=True)
        self.thread.start()

    # -- the collectives (queued; rank-major layouts as in fz/sharding/comm.py) --------------

    def all_gather(self, out: Tensor, inp: Tensor) -> LinkWork:
        """out ([n * m], rank-major) = every rank's `inp` ([m]), in rank order."""
        check_sizes(out, inp, self.n * inp.numel(), inp.numel())
        return self.all_gather_rows([[(0, row)] for row in out.view(self.n, -1)], inp)

    def all_gather_rows(self, rows: Rows, inp: Tensor | None) -> LinkWork:
        """Every rank's `inp` ([m]) lands in its `rows[q]`, wherever they are (the parameters' own
        layout: nothing to unpack); `inp` None: ours is in `rows[me]` already."""
        return self._submit(lambda: self._all_gather(rows, None if inp is None else inp.view(-1)))

    def reduce_scatter(self, out: Tensor, inp: Tensor, average: bool) -> LinkWork:
        """out ([m]) = the sum (or mean) over ranks of row `me` of every rank's `inp` ([n * m])."""
        check_sizes(out, inp, out.numel(), self.n * out.numel())
        return self.reduce_scatter_rows(out, [[(0, row)] for row in inp.reshape(self.n, -1)], average)

    def reduce_scatter_rows(self, out: Tensor, rows: Rows, average: bool) -> LinkWork:
        """As `reduce_scatter`, each rank's input read where it is: `rows[q]` holds the pieces of
        its row q (none packed first); elements no view covers are zeros."""
        return self._submit(lambda: self._reduce_scatter(out.view(-1), rows, average))

    def all_reduce(self, t: Tensor, average: bool) -> LinkWork:
        """t = the sum (or mean) of every rank's `t`, in place."""
        check_sizes(t, t, t.numel(), t.numel())
        return self._submit(lambda: self._all_reduce(t.view(-1), average))

    # -- one chunk at a time ------------------------------------------------------------------

    def _piece(self, rank: int, numel: int, dtype: torch.dtype) -> Tensor:
        base = (rank * 2 + self.seq % 2) * self.slot
        return self.buf[base:base + numel * dtype.itemsize].view(dtype)

    def _all_gather(self, rows: Rows, x: Tensor | None) -> None:
        for at, view in rows[self.me] if x is not None else ():  # ours to its place first (unless there)
            if view.data_ptr() != x[at:].data_ptr():  # type: ignore[index]  # (x is not None here)
                view.copy_(x[at:at + view.numel()])  # type: ignore[index]
        dtype = next(v.dtype for q in rows for _, v in q)
        m = max(at + v.numel() for q in rows for at, v in q)  # (the same on every rank: so are the rows)
        step = self.slot // dtype.itemsize
        for o in range(0, m, step):
            k = min(step, m - o)
            fill(self._piece(self.me, k, dtype), spans(rows[self.me], o, k))
            self._meet(0, dtype, m, o)
            for q in range(self.n):
                if q != self.me:
                    piece = self._piece(q, k, dtype)
                    for at, view in spans(rows[q], o, k):
                        view.copy_(piece[at:at + view.numel()])
            self.seq += 1

    def _reduce_scatter(self, out: Tensor, rows: Rows, average: bool) -> None:
        n, me, m = self.n, self.me, out.numel()
        step = self.slot // (out.element_size() * n)
        for o in range(0, m, step):
            k = min(step, m - o)
            mine = self._piece(me, n * k, out.dtype).view(n, k)
            for q in range(n):
                if q != me:
                    fill(mine[q], spans(rows[q], o, k))
            self._meet(1, out.dtype, m, o)
            theirs = [None if q == me else self._piece(q, n * k, out.dtype).view(n, k)[me] for q in range(n)]
            own = list(spans(rows[me], o, k))
            if sum(v.numel() for _, v in own) < k:
                out[o:o + k].zero_()  # the padding: zeros on every rank
            for at, view in own:
                c = view.numel()
                sum_in_rank_order(out[o + at:o + at + c], [view if t is None else t[at:at + c] for t in theirs],
                                  average)
            self.seq += 1

    def _all_reduce(self, x: Tensor, average: bool) -> None:
        m, step = x.numel(), self.slot // x.element_size()
        for o in range(0, m, step):
            k = min(step, m - o)
            self._piece(self.me, k, x.dtype).copy_(x[o:o + k])
            self._meet(2, x.dtype, m, o)
            sum_in_rank_order(x[o:o + k], [self._piece(q, k, x.dtype) for q in range(self.n)], average)
            self.seq += 1

    def _meet(self, kind: int, dtype: torch.dtype, numel: int, offset: int) -> None:
        """Tell every peer this chunk is in our slot; wait until each has told us theirs."""
        said = _SIGNAL.pack(kind, _dtype_code(dtype), numel, offset)
        for q, fd in self.writes.items():
            try:
                os.write(fd, said)
            except BrokenPipeError:
                raise RuntimeError(f"Connection closed: rank {q} of the shared-memory link {_GONE}") from None
        waiting = {fd: q for q, fd in self.reads.items()}
        poller = select.poll()
        for fd in waiting:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + peers.timeout_s()
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"Timed out waiting {int(peers.timeout_s() * 1000)}ms for rank(s) "
                                   f"{sorted(waiting.values())} of the shared-memory link")
            for fd, _ in poller.poll(max(1, int(left * 1000))):
                try:
                    got = os.read(fd, _SIGNAL.size)
                except BlockingIOError:
                    continue
                if not got:
                    raise RuntimeError(f"Connection closed: rank {waiting[fd]} of the shared-memory link {_GONE}")
                if got != said:
                    raise RuntimeError(f"the ranks are in different collectives: rank {waiting[fd]} is in "
                                       f"{_described(got)}, this rank in {_described(said)}")
                poller.unregister(fd)
                del waiting[fd]

    # -- the link's thread --------------------------------------------------------------------

    def _submit(self, job: Callable[[], None]) -> LinkWork:
        if self.closed:
            raise RuntimeError("this shared-memory link is closed (its process group ended)")
        work = LinkWork()
        self.jobs.put((job, work))
        return work

    def _run(self) -> None:
        torch.set_grad_enabled(False)  # (per thread) views the step made under no_grad are written here
        while True:
            job, work = self.jobs.get()
            if job is None:  # closed: the FIFOs go with the thread that uses them, once
                for fd in (*self.reads.values(), *self.writes.values()):
                    os.close(fd)
                self.reads, self.writes = {}, {}
                return
            if self.broken is None:
                try:
                    job()
                except RuntimeError as e:
                    self._break(str(e))
                except BaseException as e:  # noqa: BLE001 - an OSError of the FIFOs: the link is unusable
                    self._break(f"Connection closed: the shared-memory link failed ({type(e).__name__}: {e})")
            work.error = self.broken
            job = None  # noqa: F841 - its tensors are let go before the wait returns
            work.finished.set()

    def _break(self, why: str) -> None:
        """Fail this and every later collective, and close our write ends: the peers see it at once."""
        self.broken = why
        for fd in self.writes.values():
            os.close(fd)
        self.writes = {}

    def close(self, wait: float) -> None:
        """No more collectives: the thread finishes what is queued (waited for up to `wait` s),
        then lets go of the FIFOs."""
        if not self.closed:
            self.closed = True
            self.jobs.put((None, None))
        if wait > 0 and threading.current_thread() is not self.thread:
            self.thread.join(wait)


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def _described(signal: bytes) -> str:
    if len(signal) != _SIGNAL.size:
        return f"a signal of {len(signal)} bytes"
    kind, code, numel, offset = _SIGNAL.unpack(signal)
    dtype = _DTYPES[code] if code < len(_DTYPES) else "another dtype"
    name = _KINDS[kind] if kind < len(_KINDS) else f"collective {kind}"
    return f"{name} of {numel} elements of {dtype} (at element {offset})"


# -- opening a link: once per group, at fz.init ---------------------------------------------

def link_of(group: dist.ProcessGroup | None) -> Link | None:
    """The open link of `group`, if fz.init opened one (no collective)."""
    for ref, link in list(_links.values()):  # (a group's finalizer may drop an entry meanwhile)
        if group is not None and ref() is group:
            return link
    return None


def open_link(group: dist.ProcessGroup, ranks: tuple[int, ...], me: int, nbytes: int) -> Link | None:
    """Join `group`'s ranks (global `ranks`, this one at `me`) by shared memory, with slots of up
    to `nbytes`; None where they do not all see one /dev/shm. A collective on `group`."""
    held = _links.get(ranks)
    if held is not None and held[0]() is group:
        return held[1]
    n = len(ranks)
    slot = _slot(nbytes)
    size = buffer_bytes(n, nbytes)
    said = torch.zeros(512, dtype=torch.uint8)
    if me == 0:
        token = secrets.token_hex(16)
        text = f"{_create(n, size, token)}\n{token}".encode()
        said[:len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    _wait(dist.broadcast(said, src=ranks[0], group=group, async_op=True))
    where, token = bytes(said.tolist()).rstrip(b"\0").decode().split("\n")
    ok = torch.tensor([int(bool(where) and _sees(where, token))])
    _wait(dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group, async_op=True))
    if not ok.item():
        if me == 0 and where:
            shutil.rmtree(where, ignore_errors=True)
        log.info("fz: ranks %s do not all see one %s: gloo carries their collectives", list(ranks), _DIR)
        return None
    reads = {q: os.open(f"{where}/{q}to{me}", os.O_RDONLY | os.O_NONBLOCK) for q in range(n) if q != me}
    try:
        _wait(dist.barrier(group=group, async_op=True))  # every read end is open: the write ends open at once
        writes = {q: os.open(f"{where}/{me}to{q}", os.O_WRONLY | os.O_NONBLOCK) for q in range(n) if q != me}
        fd = os.open(f"{where}/buffer", os.O_RDWR)
        try:
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        _wait(dist.barrier(group=group, async_op=True))  # every rank holds its ends: the names can go
    finally:
        if me == 0:
            shutil.rmtree(where, ignore_errors=True)
    link = Link(n, me, torch.frombuffer(mapped, dtype=torch.uint8), slot, reads, writes, where)
    if held is not None:
        held[1].close(peers.timeout_s())  # what the old group queued runs first, on every rank alike
    _register_hooks()
    ref = weakref.ref(group, lambda r: _drop(ranks, r))
    _links[ranks] = (ref, link)
    return link


def _slot(nbytes: int) -> int:
    return min(SLOT_MAX, -(-max(nbytes, 1) // _ALIGN) * _ALIGN)


def buffer_bytes(n: int, nbytes: int) -> int:
    """Bytes a link of `n` ranks maps for collectives of up to `nbytes` per rank: two slots per
    rank, all of which each rank's resident memory counts (fz.estimate's `link`)."""
    return 2 * n * _slot(nbytes)


def _drop(ranks: tuple[int, ...], ref: weakref.ref) -> None:
    """The group is gone: so is its link (unless a newer group's link holds the ranks by now)."""
    held = _links.get(ranks)
    if held is not None and held[0] is ref:
        del _links[ranks]
        held[1].close(0)


_hooked = False


def _register_hooks() -> None:
    """At the first link, not at import: exit lets each link's thread finish (a thread ended by
    interpreter exit inside a torch op aborts the process, fz/sharding/settle.py), and a forked
    child (a DataLoader's worker) lets go of the FIFOs, so a rank that dies is seen at once."""
    global _hooked
    if not _hooked:
        _hooked = True
        atexit.register(_close_all)
        os.register_at_fork(after_in_child=_forget_in_child)


def _close_all() -> None:
    for _, link in list(_links.values()):
        link.close(0 if peers.failed else min(peers.timeout_s(), 60.0))


def _forget_in_child() -> None:
    for _, link in _links.values():
        link.closed = True
        for fd in (*link.reads.values(), *link.writes.values()):
            os.close(fd)
        link.reads, link.writes = {}, {}
    _links.clear()


def _wait(work: dist.Work | None) -> None:
    if work is not None:
        peers.wait_work(work)


def _create(n: int, size: int, token: str) -> str:
    """A directory in /dev/shm with the buffer (its memory reserved: no SIGBUS later), one FIFO
    per ordered pair of ranks and the token; "" where it cannot be made."""
    try:
        where = tempfile.mkdtemp(prefix="fz-link-", dir=_DIR)
    except OSError:
        return ""
    try:
        fd = os.open(f"{where}/buffer", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        for a in range(n):
            for b in range(n):
                if a != b:
                    os.mkfifo(f"{where}/{a}to{b}", 0o600)
        with open(f"{where}/token", "w") as f:
            f.write(token)
        return where
    except OSError:
        shutil.rmtree(where, ignore_errors=True)
        return ""


def _sees(where: str, token: str) -> bool:
    """Whether this rank sees the directory rank 0 made (the same host and /dev/shm)."""
    try:
        with open(f"{where}/token") as f:
            return f.read() == token
    except OSError:
        return False
