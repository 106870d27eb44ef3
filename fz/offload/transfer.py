"""Host <-> device transfers: one copy stream per device, an event per copy, a bounded pinned pool.

On CUDA a copy between device memory and *pinned* host memory can run on a side stream
while the compute stream goes on; the host may read (or the device reuse) the buffer only
after the copy's event, which `Transfer.wait` waits for. The source buffer is recorded on
the copy stream, so the caching allocator does not hand its memory out again before the
copy is done: dropping the last reference right after `start` is safe.

Pinning host memory is slow (a driver call per allocation) and pinned pages cannot be
swapped, so `PinnedPool` keeps the buffers it hands out and gives them out again, step
after step, up to `max_bytes` pinned in all (`Offload.max_pinned_mb`); past the bound it
hands out plain host memory (such a copy blocks the host until it is done, still correct).

torch's pinned allocator rounds every allocation up to a power of two (a 2.8B model's 47 GiB
of host state took 64.9 GiB pinned, tensor by tensor). `pinned_copy` therefore carves the
state's host tensors out of power-of-two slabs, so only the open slabs' tails are unused; the
pool's transfer buffers are charged at the rounded size against `max_bytes`, those it reserves
ahead (`PinnedPool.reserve`, carved from the slabs too) at their exact size.

On a CPU-only machine host and device are one memory: there is no stream and no pinning,
and a transfer is a plain copy into a separate buffer, so the device buffer is released
exactly as it would be on a GPU.
"""
from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

_STREAMS: dict[tuple[torch.device, bool], torch.cuda.Stream] = {}
# uploads on a stream of their own, beside the downloads' (both copy engines at once), or one
# stream for both directions
SPLIT_DIRECTIONS = False
_POOLS: dict[tuple, PinnedPool] = {}
SLAB_BYTES = 256 * 2**20  # the smallest slab state tensors are carved from (a bigger tensor gets a slab its size)
OPEN_SLABS = 4  # slabs with room kept open for the next tensors
SLAB_ALIGN = 64

# Called with the copy stream before each copy is queued on it (tests queue a slow kernel
# there to prove no buffer is read before its copy's event). None in normal use.
before_copy: Callable[[torch.cuda.Stream], None] | None = None


def copy_stream(device: torch.device, up: bool = False) -> torch.cuda.Stream | None:
    """The side stream host<->device copies of `device` run on (None off CUDA); `up`: a host->device one's."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (torch.device("cuda", index), up and SPLIT_DIRECTIONS)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device=key[0])
    return _STREAMS[key]


class Transfer:
    """`dst.copy_(src)` queued on the copy stream after everything the compute stream has queued
    (e.g. the collective that produced `src`); `wait()` blocks until `dst` holds the values."""

    def __init__(self, dst: Tensor, src: Tensor):
        self.dst, self.event = dst, None
        cuda = src.device if src.is_cuda else dst.device if dst.is_cuda else None
        if cuda is None:
            dst.copy_(src)
            return
        stream = copy_stream(cuda, up=dst.is_cuda and not src.is_cuda)
        assert stream is not None  # a CUDA device has one
        stream.wait_stream(torch.cuda.current_stream(cuda))
        if before_copy is not None:
            before_copy(stream)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        for t in (src, dst):
            if t.is_cuda:
                t.record_stream(stream)
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def wait(self) -> Tensor:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.dst


class Upload:
    """A host->device copy on the copy stream that the device waits for, not the host: `wait()`
    makes the current stream wait for the copy's event and returns `dst`, which the upload then
    lets go of (its memory is recorded on the copy stream: not reused before the copy ends). The
    source is held until the copy is `done()`, so a reused host buffer is not written while it is read."""

    def __init__(self, dst: Tensor, src: Tensor):
        self.src: Tensor | None = src
        self.event = Transfer(dst, src).event
        self.dst: Tensor | None = dst

    def wait(self) -> Tensor:
        dst, self.dst = self.dst, None
        assert dst is not None, "Upload.wait() is called once"
        if self.event is not None:
            torch.cuda.current_stream(dst.device).wait_event(self.event)
        return dst

    def done(self) -> bool:
        if self.src is not None and (self.event is None or self.event.query()):
            self.src = None
        return self.src is None

    def finish(self) -> None:
        """The host waits for the copy (before its source may change)."""
        if self.event is not None:
            self.event.synchronize()
        self.src = self.dst = None


class PinnedPool:
    """Host buffers for transfers, reused across steps; at most `max_bytes` of them pinned."""

    def __init__(self, pin: bool, max_bytes: int | None):
        self.pin = pin and torch.cuda.is_available()
        self.max_bytes = max_bytes
        self.free: dict[tuple, list[Tensor]] = {}
        self.pinned_bytes = 0  # held by the pool or lent out, pinned
        # `_owner_gone` runs from a finalizer, on any thread, or on this one inside a locked call
        # whose allocation set off the garbage collector: reentrant
        self.lock = threading.RLock()
        self.owners: set[int] = set()  # ids of the owners of kept plain buffers (`give`)
        self.keeper: dict[int, int] = {}  # id of a kept plain buffer waiting in `free` -> its owner's id

    def reserve(self, sizes: Sequence[tuple[int, torch.dtype]]) -> None:
        """Pin now the buffers a step will take: each (numel, dtype) asked for gets a buffer carved
        at its exact size from pinned slabs (`Slabs`) to wait in the pool, unless one of that size
        waits there already, within `max_bytes`. fz.init reserves the step's fp32 host gradients:
        pinned by the first step, their 11 GB took seconds of it on an H200 host, and torch's
        allocator rounded each up to a power of two."""
        if not self.pin:
            return
        for (numel, dtype), n in Counter(sizes).items():
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            for _ in range(n - len(self.free.get((numel, dtype), []))):
                with self.lock:  # the room is taken first; the slow pinning runs outside the lock
                    if self.max_bytes is not None and self.pinned_bytes + nbytes > self.max_bytes:
                        return
                    self.pinned_bytes += nbytes
                t = _slabs().empty(numel, dtype)
                with self.lock:
                    self.free.setdefault((numel, dtype), []).append(t)

    def take(self, numel: int, dtype: torch.dtype, pin: bool = True) -> Tensor:
        """A 1-D host buffer of `numel` elements (uninitialised); `pin=False`: never newly pinned."""
        with self.lock:
            spare = self.free.get((numel, dtype))
            if spare:
                t = spare.pop()
                self.keeper.pop(id(t), None)
                return t
        nbytes = rounded(numel * torch.empty((), dtype=dtype).element_size())  # what the allocator pins
        pin = pin and self.pin and (self.max_bytes is None or self.pinned_bytes + nbytes <= self.max_bytes)
        t = torch.empty(numel, dtype=dtype, pin_memory=pin)
        if pin:
            self.pinned_bytes += nbytes
        return t

    def give(self, t: Tensor, keep_for: object | None = None) -> None:
        """Return a buffer from `take`. Pinned ones are kept. Plain ones are kept only for an owner
        (`keep_for`, the state's plan: where host and device are one memory and the step's host
        gradients live in them, reused they are not mapped and zeroed afresh each step), until it
        is garbage (that run's last state dropped); else they go back to the allocator. The pool
        is the process's: each owner's buffers go with that owner alone."""
        if t.device.type != "cpu" or not (t.is_pinned() or keep_for is not None):
            return
        with self.lock:
            self.free.setdefault((t.numel(), t.dtype), []).append(t)
            if t.is_pinned() or keep_for is None:
                return
            self.keeper[id(t)] = id(keep_for)
            if id(keep_for) not in self.owners:
                self.owners.add(id(keep_for))
                weakref.finalize(keep_for, self._owner_gone, id(keep_for))

    def _owner_gone(self, owner: int) -> None:
        with self.lock:
            self.owners.discard(owner)
            self._drop(lambda key, t: self.keeper.get(id(t)) == owner)

    def keep_only(self, sizes: set[tuple[int, torch.dtype]], owner: object) -> None:
        """Let go of `owner`'s kept plain buffers of every (numel, dtype) not in `sizes` (its last
        step's); other owners' stay."""
        with self.lock:
            self._drop(lambda key, t: key not in sizes and self.keeper.get(id(t)) == id(owner))

    def _drop(self, goes: Callable[[tuple, Tensor], bool]) -> None:
        """Let go of the waiting plain buffers `goes` picks (under the lock)."""
        for key, spare in list(self.free.items()):
            gone = {id(t) for t in spare if not t.is_pinned() and goes(key, t)}
            for i in gone:
                self.keeper.pop(i, None)
            spare[:] = [t for t in spare if id(t) not in gone]
            if not spare:
                del self.free[key]

    def clear(self) -> None:
        with self.lock:
            self.free.clear()
            self.pinned_bytes = 0


def rounded(nbytes: int) -> int:
    """The bytes torch's pinned allocator takes for an `nbytes` request (the next power of two)."""
    return 1 << max(nbytes - 1, 0).bit_length()


class Slabs:
    """Host tensors carved out of power-of-two slabs (pinned when `pin`): exact sizes, no rounding.

    A slab lives as long as any tensor carved from it. This object keeps the `OPEN_SLABS` with
    the most room left and puts each tensor in the one it fills best; a tensor bigger than
    `SLAB_BYTES` gets a slab of its own rounded size, whose rest later tensors fill. On a 2.8B
    GPT's host state (bf16 params, fp32 masters and Adam moments) that wastes 4% against
    the allocator's 38%."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.open: list[list] = []  # [slab, bytes handed out]
        self.slab_bytes = 0  # bytes of every slab this object allocated

    def copy(self, t: Tensor) -> Tensor:
        """A contiguous host copy of `t` in a slab."""
        return self.empty(t.numel(), t.dtype).view(t.shape).copy_(t)

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        """An uninitialised 1-D host tensor of `numel` elements in a slab."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        size = -(-nbytes // SLAB_ALIGN) * SLAB_ALIGN
        fits = [o for o in self.open if o[0].numel() - o[1] >= size]
        if fits:
            entry = min(fits, key=lambda o: o[0].numel() - o[1])
        else:
            entry = [torch.empty(max(SLAB_BYTES, rounded(size)), dtype=torch.uint8, pin_memory=self.pin), 0]
            self.slab_bytes += entry[0].numel()
            self.open.append(entry)
        slab, used = entry
        entry[1] += size
        self.open = sorted(self.open, key=lambda o: o[1] - o[0].numel())[:OPEN_SLABS]  # most room first
        return slab[used:used + nbytes].view(dtype)


_SLABS: Slabs | None = None  # the process's pinned slabs, made at the first pinned copy


def pinned_copy(t: Tensor) -> Tensor:
    """`t` copied into pinned host memory of exactly its size (see `Slabs`)."""
    if t.is_pinned() and t.device.type == "cpu":
        return t
    if not torch.cuda.is_available():
        return t.to("cpu")
    return _slabs().copy(t)


def _slabs() -> Slabs:
    global _SLABS
    if _SLABS is None:
        _SLABS = Slabs(pin=True)
    return _SLABS


def pool_for(policy: Any) -> PinnedPool:  # an Offload (whose module imports this one)
    """The process's pool for an offload policy's pinning settings (shared by its states)."""
    mb = getattr(policy, "max_pinned_mb", None)
    key = (bool(policy.pin_memory), None if mb is None else int(mb * 2**20))
    if key not in _POOLS:
        _POOLS[key] = PinnedPool(*key)
    return _POOLS[key]


def pinned_bytes() -> int:
    """Bytes of host memory fz's pools hold pinned in this process (memory_report shows them)."""
    return sum(p.pinned_bytes for p in _POOLS.values())
