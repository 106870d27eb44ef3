"""Updated parameters landing where they live, bucket by bucket, while the update goes on.

Where the fp32 masters are in host memory but a bucket's parameters cannot be cast in place
there (on a GPU; or gathered after a sharded update: fz/step/updaters.py `host_casts` takes
the others), the update still writes their new values in its own pass (the host AdamW
kernel's: fz/optim/kernel.py), into a buffer in the parameters' dtype, one bucket at a time
(`Landing.groups`):

- on a GPU, a pinned staging buffer, copied up on the copy stream as soon as its bucket is
  updated (into the parameters themselves, or into the all-gather's input where the bucket
  is gathered), while the host updates the next bucket: the transfers of one bucket overlap
  the update of the next. At most `MAX_UPLOADS` staging buffers, each the largest bucket's
  size, are in flight; the host waits for the oldest only to reuse its buffer, and for the
  last ones as the update ends.
- on a CPU-only machine (one memory), where asked (`landing_for(one_memory=True)`: the tests),
  the all-gather's input itself; by default such a machine casts after the update (see there).

Before, these buckets were cast after the update (a second pass over the masters) and
copied up one after another, each copy blocking the host; DeepSpeed's stage 1/2 CPU offload
also copies its fp32 partitions into the bit16 ones after its CPU Adam step.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
from torch import Tensor

from fz.offload.transfer import PinnedPool, Transfer
from fz.optim.base import CastGroups, Params
from fz.sharding.sync import gathered

MAX_UPLOADS = 2  # staging buffers whose copy to the device may be in flight while the next bucket is updated


class Landing:
    """The casts of one update for the buckets `indices` (in update order); `finish()` once it is
    done. Then `cast` names the buckets whose parameters hold the update, and `ready` maps each
    gathered bucket to this rank's updated rows in the parameters' dtype, where they live (the
    all-gather's input: fz/sharding/sync.py)."""

    def __init__(self, plan, flats: Sequence[Tensor], mflats: Sequence[Tensor | None], indices: list[int],
                 pool: PinnedPool | None):
        self.plan, self.flats, self.mflats, self.indices, self.pool = plan, flats, mflats, indices, pool
        self.groups = CastGroups([[s.name for s in plan.buckets[j].slots] for j in indices], self._open, self._close)
        self.cast = frozenset(j for j in indices if not gathered(plan, plan.buckets[j]))
        self.ready: dict[int, Tensor] = {}
        self.width = max(self._numel(j) for j in indices)  # elements of a staging buffer
        self.staged: dict[int, Tensor] = {}  # group -> its staging buffer, open
        self.uploads: deque[tuple[Transfer, Tensor]] = deque()  # (copy, its staging buffer), oldest first

    def _numel(self, j: int) -> int:
        mflat = self.mflats[j]
        assert mflat is not None  # `landing_for` picks buckets with masters
        return mflat.numel()

    def _open(self, i: int) -> Params:
        j = self.indices[i]
        b, flat, n = self.plan.buckets[j], self.flats[j], self._numel(j)
        if flat.device.type != "cuda":  # one memory: the update writes the gather's input itself
            buf = self.ready[j] = torch.empty(n, dtype=flat.dtype, device=flat.device)
        else:
            while len(self.uploads) >= MAX_UPLOADS:
                self._retire()
            assert self.pool is not None  # a GPU run's offload policy has one
            self.staged[i] = self.pool.take(self.width, flat.dtype)
            buf = self.staged[i][:n]
        return dict(zip((s.name for s in b.slots), self.plan.master_locals(buf, b)))

    def _close(self, i: int) -> None:
        staging = self.staged.pop(i, None)
        if staging is None:  # one memory: nothing to copy
            return
        j = self.indices[i]
        flat, n = self.flats[j], self._numel(j)
        dst = flat if j in self.cast else torch.empty(n, dtype=flat.dtype, device=flat.device)
        if j not in self.cast:
            self.ready[j] = dst
        self.uploads.append((Transfer(dst, staging[:n]), staging))

    def _retire(self) -> None:
        """The oldest copy done (the host waits for it); its staging buffer back to the pool."""
        copy, staging = self.uploads.popleft()
        copy.wait()
        assert self.pool is not None
        self.pool.give(staging)

    def finish(self) -> None:
        """Every copy done (the host waits for the last ones: at most MAX_UPLOADS buckets); every
        staging buffer back to the pool."""
        while self.uploads:
            self._retire()
        for staging in self.staged.values():  # opened and never closed: the update failed
            if self.pool is not None:
                self.pool.give(staging)
        self.staged.clear()


def landing_for(plan, flats: Sequence[Tensor], mflats: Sequence[Tensor | None], done: frozenset[int],
                pool: PinnedPool | None, one_memory: bool = False) -> Landing | None:
    """A Landing for the trainable buckets with masters in host memory and parameters on a GPU
    that `done` (cast in place) leaves out; None when there is none. `one_memory`: on a CPU-only
    machine too, for the buckets gathered after a sharded update. Not by default: the live bytes
    are the same and the step within 3% (22M GPT, stages 1-2, world 2), but with the gather's
    inputs made during the update glibc kept 10% more peak RSS (`benchmarks/step.py --baseline`;
    with `malloc_trim` after each step both paths hold the same)."""
    indices = [b.index for b, flat, mflat in zip(plan.buckets, flats, mflats)
               if b.trainable and b.index not in done and mflat is not None and mflat.device.type == "cpu"
               and (flat.device.type == "cuda" or (one_memory and gathered(plan, b)))]
    return Landing(plan, flats, mflats, indices, pool) if indices else None
