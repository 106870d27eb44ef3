"""Stage 3's just-in-time parameters: all-gather for forward, again for backward, no recompute.

`gather_bucket(shard)` is differentiable: the gradient of the gathered parameters is
reduce-scattered (averaged over ranks) back onto the local shard. `Gatherer` runs the
all-gathers and can start the next block's while this one computes (prefetch).
While a unit runs forward, `ParamSaver` replaces every gathered parameter that autograd
would save for backward (a weight, or a view of one) by a small marker, so the gathered
bucket dies with the unit's forward. When backward unpacks a marker, the bucket is
gathered once more and kept until its gradients have been reduce-scattered. Activations
are saved as usual: nothing is recomputed.

Where the shards live off the device (offloaded parameters, `Comm.params_off`), each gather
starts with this rank's shard crossing up (the whole bucket with one rank): counted in
`comm.h2d` by what the gather is for, "forward" or "recompute" (backward's gathers, and
those prefetched for it), where the copy is issued. With one rank a prefetch is that upload
alone, queued on the copy stream (`Uploader`): it runs beside the running unit's kernels,
and the device, not the host, waits for it (a shard on disk is read ahead instead).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch
from torch import Tensor

from fz.sharding.buckets import Bucket
from fz.sharding.comm import Comm, full_views, unpack, unpack_into
from fz.sharding.settle import Handle
from fz.storage.disk import DiskTensor
from fz.storage.scratch import SCRATCH

_READS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fz-param-read")  # preadv releases the GIL


class LiveCounter:
    """How many gathered buckets (and elements) are alive now, and the most ever seen."""

    def __init__(self) -> None:
        self.buckets = self.elements = 0
        self.max_buckets = self.max_elements = 0
        self.unprefetched = 0  # gathers that found no prefetch in flight (each one waits in full)

    def acquire(self, numel: int) -> None:
        """A gather in flight (prefetched) counts as live."""
        self.buckets += 1
        self.elements += numel
        self.max_buckets = max(self.max_buckets, self.buckets)
        self.max_elements = max(self.max_elements, self.elements)

    def release(self, numel: int) -> None:
        self.buckets -= 1
        self.elements -= numel

    def reset_max(self) -> None:
        self.max_buckets, self.max_elements = self.buckets, self.elements
        self.unprefetched = 0

    def track(self, tensors: tuple[Tensor, ...], numel: int) -> None:
        """Gathered tensors count as live until the last of them is freed."""
        self.acquire(numel)
        left = [len(tensors)]

        def release() -> None:
            left[0] -= 1
            if left[0] == 0:
                self.release(numel)

        for t in tensors:
            weakref.finalize(t, release)


class UploadInFlight(Protocol):
    """A host->device copy in flight (fz/offload/transfer.py's): `wait` makes the device wait
    for it and returns the destination; `done`, whether its source may be let go; `finish`,
    the host waits for it."""

    def wait(self) -> Tensor: ...

    def done(self) -> bool: ...

    def finish(self) -> None: ...


Uploader = Callable[[Tensor, Tensor], UploadInFlight]  # (device buffer, host source) -> the copy, started


class Gatherer:
    """A step's all-gathers of sharded buckets: on demand, or prefetched asynchronously.

    Prefetch decisions depend only on the model's call order (the same on every rank),
    so every rank issues the same collectives in the same order. With one rank there is
    nothing to gather: a prefetch uploads an offloaded shard (`uploader`) ahead of use.
    """

    def __init__(self, comm: Comm, live: LiveCounter, uploader: Uploader | None = None):
        self.comm, self.live, self.uploader = comm, live, uploader
        self.uploading: dict[int, tuple[UploadInFlight, int]] = {}  # one rank: bucket index -> (upload, elements)
        self.uploads: list[UploadInFlight] = []  # used, maybe still copying: their sources are held until done
        self.kind = "forward"  # what gathers are for now: "recompute" while backward runs (the Runner sets it)
        self.inflight: dict[int, tuple[Tensor, Handle, int]] = {}  # bucket index -> (buffer, work, elements)
        self.reads: dict[int, Future] = {}  # shards on the disk tier being read ahead
        self.users: dict[int, int] = {}  # buckets several units use (a tied embedding and head) -> how many
        self.held: dict[int, tuple[tuple[Tensor, ...], int]] = {}  # this forward's gathers of those, uses left

    def read_ahead(self, bucket: Bucket, shard: Tensor) -> None:
        """Start reading a shard that lives on disk, so its gather finds it in memory."""
        if (isinstance(shard, DiskTensor) and bucket.index not in self.reads and bucket.index not in self.inflight
                and bucket.index not in self.uploading and bucket.index not in self.held):
            self.reads[bucket.index] = _READS.submit(shard.load, pooled=True)

    def _source(self, bucket: Bucket, shard: Tensor) -> Tensor:
        """The shard's values where they are: read ahead from disk, loaded now, or the shard itself."""
        read = self.reads.pop(bucket.index, None)
        if read:
            return read.result()
        return shard.load(pooled=True) if isinstance(shard, DiskTensor) else shard

    def _local(self, bucket: Bucket, shard: Tensor, kind: str) -> Tensor:
        return self._counted_source(bucket, shard, kind).to(self.comm.device, non_blocking=True)

    def _counted_source(self, bucket: Bucket, shard: Tensor, kind: str) -> Tensor:
        """`_source`, its bytes counted as crossing up for `kind`."""
        src = self._source(bucket, shard)
        self._count_up(kind, src.numel() * src.element_size())
        return src

    def _count_up(self, kind: str, nbytes: int) -> None:
        if self.comm.params_off:  # the shard lives on the host (or was read from disk into it)
            self.comm.h2d[kind] += nbytes

    def prefetch(self, bucket: Bucket, shard: Tensor, kind: str | None = None) -> None:
        """Start gathering `bucket` for `kind` (default: what gathers are for now); with one rank,
        uploading its offloaded shard."""
        if bucket.index in self.inflight or bucket.index in self.uploading or bucket.index in self.held:
            return
        if self.comm.world == 1:
            # a shard on disk keeps its read ahead instead (an upload here would wait for its read now)
            if self.uploader is not None and self.comm.params_off and not isinstance(shard, DiskTensor):
                src = self._counted_source(bucket, shard.detach(), kind or self.kind)
                self.uploading[bucket.index] = (self.uploader(self._device_buffer(src), src), bucket.full_numel)
                self.live.acquire(bucket.full_numel)
            return
        full = self._buffer(bucket, shard.dtype)
        local = self._local(bucket, shard.detach(), kind or self.kind)
        self.inflight[bucket.index] = (full, self._all_gather(full, local, bucket), bucket.full_numel)
        self.live.acquire(bucket.full_numel)

    def _buffer(self, bucket: Bucket, dtype: torch.dtype) -> Tensor:
        """Where a gather lands: the parameters' layout where ranks share memory (written in place
        by the link), else the collective's rank-major one."""
        if self.comm.link is not None:
            return SCRATCH.empty(bucket.full_numel, dtype, self.comm.device)
        return SCRATCH.empty(bucket.padded_numel, dtype, self.comm.device)

    def _all_gather(self, full: Tensor, local: Tensor, bucket: Bucket) -> Handle:
        if self.comm.link is not None:
            return self.comm.all_gather_params(full, local, bucket, async_op=True)
        return self.comm.all_gather(full, local, async_op=True)

    def gather(self, bucket: Bucket, shard: Tensor) -> tuple[Tensor, ...]:
        """The bucket's full parameters (a shard on the disk tier is read first). A bucket several
        units use is gathered once a forward, by the first, and held until the last has taken it
        (DeepSpeed keeps a parameter reused within its `stage3_max_reuse_distance` alike): each
        use gets views of its own (its own autograd node), no second transfer."""
        held = self.held.get(bucket.index) if self.kind == "forward" else None
        if held is not None:
            outs, left = held
            if left > 1:
                self.held[bucket.index] = (outs, left - 1)
            else:
                del self.held[bucket.index]
            views = tuple(t.view_as(t) for t in outs)
            self.live.track(views, bucket.full_numel)  # (the held ones are let go: one bucket, counted once)
            return views
        outs = self._gathered(bucket, shard)
        if self.kind == "forward" and self.users.get(bucket.index, 1) > 1:
            self.held[bucket.index] = (outs, self.users[bucket.index] - 1)
        return outs

    def end_forward(self) -> None:
        """Let go of what a forward held for uses that did not come (a unit not called)."""
        self.held.clear()

    def _device_buffer(self, src: Tensor) -> Tensor:
        return SCRATCH.empty(src.numel(), src.dtype, self.comm.device)

    def _gathered(self, bucket: Bucket, shard: Tensor) -> tuple[Tensor, ...]:
        if self.comm.world == 1:  # the bucket copied once, from wherever the shard lives, to the device
            self.uploads = [u for u in self.uploads if not u.done()]
            if bucket.index in self.uploading:
                upload, _ = self.uploading.pop(bucket.index)
                full = upload.wait()
                self.uploads.append(upload)
                self.live.release(bucket.full_numel)
            else:
                src = self._counted_source(bucket, shard, self.kind)
                if self.comm.params_off:
                    self.live.unprefetched += 1
                full = self._device_buffer(src).copy_(src, non_blocking=True)
            outs = tuple(unpack(full, bucket))
        else:
            if bucket.index in self.inflight:
                full, work, _ = self.inflight.pop(bucket.index)
                work.wait()
                self.live.release(bucket.full_numel)
            else:
                self.live.unprefetched += 1
                full = self._buffer(bucket, shard.dtype)
                self._all_gather(full, self._local(bucket, shard, self.kind), bucket).wait()
            outs = tuple(full_views(full, bucket)) if self.comm.link is not None else _unpacked(full, bucket)
        self.live.track(outs, bucket.full_numel)
        return outs

    def close(self) -> None:
        self.held.clear()
        for _index, (_, work, numel) in list(self.inflight.items()):
            work.wait()
            self.live.release(numel)  # prefetched, never used: no longer alive
        self.inflight.clear()
        for upload, numel in self.uploading.values():
            upload.finish()  # its source (a parameter shard) may change next
            self.live.release(numel)
        self.uploading.clear()
        for upload in self.uploads:
            upload.finish()
        self.uploads.clear()
        for read in self.reads.values():
            read.exception()  # a read nobody used: let it finish (its error, if any, is not this step's)
        self.reads.clear()


def _unpacked(full: Tensor, bucket: Bucket) -> tuple[Tensor, ...]:
    """A gathered bucket's parameters, param-major. Where the host buffer pool is on (the disk
    tier's store) they are views of one reused buffer: otherwise each parameter is a copy into
    fresh memory, page-faulted in again at every gather."""
    if not SCRATCH.enabled or full.device.type != "cpu":
        return tuple(unpack(full, bucket))
    flat = SCRATCH.empty(bucket.full_numel, full.dtype, full.device)
    unpack_into(full, bucket, flat)
    return tuple(full_views(flat, bucket))


class ParamSaver:
    """saved_tensors_hooks that save gathered parameters as markers and re-gather on use."""

    def __init__(self, gatherer: Gatherer, on_regather: Callable[[Bucket, int], None]):
        self.gatherer, self.on_regather = gatherer, on_regather
        self.owner: dict[int, tuple[Bucket, Tensor, int, int]] = {}  # storage ptr -> (bucket, shard, slot, unit)
        self.regathered: dict[int, tuple[Tensor, ...]] = {}
        self.marked: set = set()  # units this forward saved a marker for: their backward gathers again

    def register(self, bucket: Bucket, shard: Tensor, tensors: tuple[Tensor, ...], unit: int) -> None:
        """`unit`: the unit the bucket was gathered for (a bucket several units share has one owner)."""
        for i, t in enumerate(tensors):
            ptr = t.untyped_storage().data_ptr()
            self.owner[ptr] = (bucket, shard, i, unit)
            weakref.finalize(t, self.owner.pop, ptr, None)

    def pack(self, t: Tensor):
        hit = self.owner.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        if hit is None:
            return t
        bucket, shard, i, unit = hit
        self.marked.add(unit)
        return (_Marker, bucket, shard, i, unit, t.size(), t.stride(), t.storage_offset())

    def unpack(self, saved):
        if not (isinstance(saved, tuple) and saved and saved[0] is _Marker):
            return saved
        _, bucket, shard, i, unit, size, stride, offset = saved
        tensors = self.regathered.get(bucket.index)
        if tensors is None:
            with torch.no_grad():
                tensors = self.regathered[bucket.index] = self.gatherer.gather(bucket, shard)
            self.on_regather(bucket, unit)
        return tensors[i].as_strided(size, stride, offset)

    def release(self, bucket: Bucket) -> None:
        self.regathered.pop(bucket.index, None)


class _Marker:
    """Stands in a saved-tensor slot for a gathered parameter."""


class _GatherBucket(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard: Tensor, bucket: Bucket, gatherer: Gatherer, saver, grad_sink, unit: int):
        ctx.bucket, ctx.saver, ctx.grad_sink = bucket, saver, grad_sink
        outs = gatherer.gather(bucket, shard)
        if saver is not None:
            saver.register(bucket, shard, outs, unit)
        return outs

    @staticmethod
    def backward(ctx, *grads: Tensor):
        if ctx.saver is not None:
            ctx.saver.release(ctx.bucket)  # every use of this bucket has had its backward
        ctx.grad_sink(ctx.bucket, grads)  # the step reduce-scatters asynchronously and keeps the shard
        return None, None, None, None, None, None


def gather_bucket(shard: Tensor, bucket: Bucket, gatherer: Gatherer, saver: ParamSaver | None = None,
                  grad_sink: Callable | None = None, unit: int | None = None) -> list[Tensor]:
    """The bucket's full parameters, gathered from every rank's shard (for `unit`: by default
    the bucket's own).

    Backward sends the parameters' gradients to `grad_sink(bucket, grads)` (the step's
    asynchronous reduce-scatter); without a sink (no grad needed) nothing flows back.
    """
    return list(_GatherBucket.apply(shard, bucket, gatherer, saver, grad_sink,
                                    bucket.unit if unit is None else unit))
