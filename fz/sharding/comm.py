"""Collectives on flat buckets, and the copies between the two bucket layouts.

A bucket's *full* layout is its parameters concatenated (what the model reads); its
*rank-major* layout is [world, shard_numel]: row r holds rank r's Shard(0) rows of every
parameter, zero-padded to a common chunk, so one all-gather or reduce-scatter moves the
whole bucket. With one rank both layouts are the same and nothing is copied or sent.
"""
from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from fz.compat import all_gather_single, reduce_scatter_single
from fz.distributed import shm
from fz.distributed.rows import Rows, sum_in_rank_order
from fz.sharding.buckets import Bucket
from fz.sharding.settle import Handle
from fz.storage.scratch import SCRATCH

_TAGS = 1 << 20


def _done(handle: Handle, async_op: bool):
    """The handle (async) or the finished collective (its tensors released: fz/sharding/settle.py)."""
    return handle if async_op else handle.wait()


def _mode() -> str:
    """FZ_COLLECTIVES: "auto" (ranks of one host share memory: fz/distributed/shm.py; gloo's
    other ranks exchange pairwise), "pairwise" (gloo's point-to-point only) or "native"."""
    mode = os.environ.get("FZ_COLLECTIVES", "auto")
    if mode not in ("auto", "pairwise", "native"):
        raise ValueError(f"FZ_COLLECTIVES={mode!r}: use 'auto', 'pairwise' or 'native'")
    return mode


def _gloo_fast_paths(group) -> bool:
    """gloo's reduce-scatter and all-gather are slower than a pairwise exchange and N broadcasts
    of the same data (measured: benchmarks/RESULTS.md). FZ_COLLECTIVES=native turns this off."""
    return _mode() != "native" and dist.get_backend(group) == "gloo"


def connect(plan) -> None:
    """At fz.init, on every rank: a CPU shard group of one host shares memory for its collectives
    (fz/distributed/shm.py), with slots as large as a bucket's largest reduction (capped)."""
    if (plan.shards > 1 and plan.buckets and plan.device.type == "cpu" and _mode() == "auto"
            and _gloo_fast_paths(plan.shard_group)):
        shm.open_link(plan.shard_group, plan.shard_ranks, plan.shard_rank, _largest_reduction(plan.buckets))


def _largest_reduction(buckets: Sequence[Bucket]) -> int:
    return 4 * max(max(b.padded_numel, b.full_numel) for b in buckets)  # fp32: the widest reduce dtype


def link_bytes(buckets: Sequence[Bucket], shards: int) -> int:
    """What `connect` maps on each rank of a CPU shard group (fz.estimate's `link`)."""
    return shm.buffer_bytes(shards, _largest_reduction(buckets)) if shards > 1 and buckets else 0


class Comm:
    """One step's collectives on a plan's groups, counting the bytes each kind moves.

    ZeRO's collectives run within the shard group (`world` ranks, this one is `rank`);
    on a 2-D mesh, `replica_mean` averages across the groups (`replicas` of them), counted
    apart as "inter_*". A Comm lives for one step (or one eval): states share none.

    It also counts the step's copies between the host tier and the device (`h2d`, `d2h`:
    kind -> bytes), at the one place each is issued, from the tiers the offload policy
    (`offload`) puts tensors in, not from where they happen to be: on a CPU-only machine host
    and device are one memory and the copies are no-ops or plain copies, yet they are counted
    as a GPU would make them, so the CPU tests see the traffic of a GPU run (comm_report).
    """

    def __init__(self, plan, reduce_dtype: torch.dtype = torch.float32, offload=None):
        self.group, self.world, self.rank = plan.shard_group, plan.shards, plan.shard_rank
        self.replica_group, self.replicas = plan.replica_group, plan.replicas
        self.reduce_dtype = reduce_dtype  # gradients are summed in this dtype
        self.bytes: Counter = Counter()  # collective kind -> payload bytes
        self.fast = self.world > 1 and _gloo_fast_paths(self.group)
        self.link = shm.link_of(self.group) if self.fast and _mode() == "auto" else None
        self.ranks = plan.shard_ranks
        self.device = plan.device
        self._tag = 0  # point-to-point messages of one exchange share a tag; every rank counts alike
        # the tiers of this step's parameter shards and optimizer state (an fz.offload.Offload or None):
        # off the device, their copies to and from it are counted (integer adds, no sync)
        self.params_off = offload is not None and offload.params != "device"
        self.opt_off = offload is not None and offload.optimizer != "device"
        self.h2d: Counter = Counter()  # "forward", "recompute", "other" -> bytes up
        self.d2h: Counter = Counter()  # "grads", "other" -> bytes down

    def replica_mean(self, t: Tensor, async_op: bool = False):
        """Average `t` across the replica groups (a 2-D mesh's only inter-group traffic)."""
        if self.replicas == 1:
            return None
        self.bytes["inter_all_reduce" if t.numel() > 8 else "inter_scalar"] += t.numel() * t.element_size()
        h = Handle([t])
        return _done(h.add(dist.all_reduce(t, op=dist.ReduceOp.AVG, group=self.replica_group, async_op=True)), async_op)

    def replica_sum(self, t: Tensor, scalar: bool = False) -> None:
        """Sum `t` across the replica groups, in place (`scalar`: count it with the scalars)."""
        if self.replicas > 1:
            self.bytes["inter_scalar" if scalar or t.numel() <= 8 else "inter_all_reduce"] += (
                t.numel() * t.element_size()
            )
            Handle([t]).add(dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.replica_group, async_op=True)).wait()

    def broadcast_first(self, t: Tensor) -> None:
        """Every rank of the mesh gets the first rank's `t` (within groups, then across)."""
        if self.world > 1:
            Handle([t]).add(dist.broadcast(t, src=self.ranks[0], group=self.group, async_op=True)).wait()
        if self.replicas > 1:
            src = dist.get_process_group_ranks(self.replica_group)[0]
            Handle([t]).add(dist.broadcast(t, src=src, group=self.replica_group, async_op=True)).wait()

    def _count_all_reduce(self, t: Tensor, scalar: bool = False) -> None:
        # losses, norms and flags are counted apart from the model-sized traffic
        self.bytes["scalar" if scalar or t.numel() <= 8 else "all_reduce"] += t.numel() * t.element_size()

    def all_reduce(self, t: Tensor, async_op: bool = False):
        self._count_all_reduce(t)
        h = Handle([t])
        if self.link is not None:
            return _done(h.add(self.link.all_reduce(t, average=True)), async_op)
        return _done(h.add(dist.all_reduce(t, op=dist.ReduceOp.AVG, group=self.group, async_op=True)), async_op)

    def all_reduce_sum(self, t: Tensor, async_op: bool = False, scalar: bool = False):
        self._count_all_reduce(t, scalar)
        h = Handle([t])
        if self.link is not None:
            return _done(h.add(self.link.all_reduce(t, average=False)), async_op)
        return _done(h.add(dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)), async_op)

    def sum_now(self, t: Tensor) -> None:
        """Sum `t` (a few values) over every rank of the mesh, in place, on gloo's own connections:
        never queued behind the shared-memory link's bucket collectives, such as the last step's
        parameter gathers still in flight while the next forward starts."""
        self._count_all_reduce(t, scalar=True)
        if self.world > 1:
            Handle([t]).add(dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)).wait()
        self.replica_sum(t, scalar=True)

    def reduce_scatter(self, out: Tensor, inp: Tensor, async_op: bool = False):
        """out = this rank's 1/world of the average of every rank's `inp` (rank-major)."""
        self.bytes["reduce_scatter"] += inp.numel() * inp.element_size()
        if self.link is not None:
            return _done(Handle([out, inp]).add(self.link.reduce_scatter(out, inp, average=True)), async_op)
        if self.fast:
            return _done(self._exchange_sum(out, inp), async_op)
        h = Handle([out, inp])
        return _done(h.add(reduce_scatter_single(out, inp, op=dist.ReduceOp.AVG, group=self.group, async_op=True)),
                     async_op)

    def _exchange_sum(self, out: Tensor, inp: Tensor) -> Handle:
        """Reduce-scatter as a pairwise exchange: send each rank its rows of `inp`, receive
        ours from every rank, and sum them in rank order (the same order on every rank and
        for every stage, so results do not depend on who reduced them)."""
        n, r = self.world, self.rank
        parts = inp.view(n, -1)
        others = [q for q in range(n) if q != r]
        recv = SCRATCH.empty((n - 1) * parts.shape[1], inp.dtype, inp.device).view(n - 1, parts.shape[1])
        pairs = [((r + k) % n, (r - k) % n) for k in range(1, n)]
        sends = [parts[dst] for dst, _ in pairs]
        recvs = [recv[others.index(src)] for _, src in pairs]
        h = Handle([*sends, *recvs])
        for (dst, src), out_piece, in_piece in zip(pairs, sends, recvs):
            h.add(dist.isend(out_piece, dst=self.ranks[dst], group=self.group, tag=self._tag))
            h.add(dist.irecv(in_piece, src=self.ranks[src], group=self.group, tag=self._tag))
        self._tag = (self._tag + 1) % _TAGS

        def total() -> None:
            sum_in_rank_order(out, [parts[q] if q == r else recv[others.index(q)] for q in range(n)], True)
        h.then = total
        return h

    def all_gather(self, out: Tensor, inp: Tensor, async_op: bool = False, counted: bool = False):
        """out (rank-major) = every rank's `inp`, in rank order (`counted`: its bytes already were)."""
        if not counted:
            self.bytes["all_gather"] += out.numel() * out.element_size()
        if self.link is not None:
            return _done(Handle([out, inp]).add(self.link.all_gather(out, inp)), async_op)
        if self.fast:  # each rank broadcasts its piece
            parts = out.view(self.world, -1)
            parts[self.rank].copy_(inp)
            pieces = [parts[r] for r in range(self.world)]
            h = Handle(pieces)
            for piece, g in zip(pieces, self.ranks):
                h.add(dist.broadcast(piece, src=g, group=self.group, async_op=True))
            return _done(h, async_op)
        h = Handle([out, inp])
        return _done(h.add(all_gather_single(out, inp, group=self.group, async_op=True)), async_op)

    def reduce_scatter_params(self, out: Tensor, tensors: Sequence[Tensor | None], bucket: Bucket,
                              async_op: bool = False):
        """out = this rank's rows of the average over ranks of `tensors` (full-shape, one per slot,
        None = zeros): `reduce_scatter` of their `pack`, read in place where the ranks share memory."""
        if self.link is None:
            return self.reduce_scatter(out, pack(tensors, bucket, out.dtype, out.device), async_op)
        self.bytes["reduce_scatter"] += bucket.padded_numel * out.element_size()
        rows = rows_by_rank(tensors, bucket)
        return _done(Handle([out]).add(self.link.reduce_scatter_rows(out, rows, average=True)), async_op)

    def all_gather_params(self, flat: Tensor, inp: Tensor | None, bucket: Bucket, async_op: bool = False,
                          counted: bool = False):
        """Ranks that share memory only (`self.link`): flat (the bucket's full layout) = every
        rank's shard `inp`, each rank's rows written in place (`all_gather` and `unpack_into` in
        one); `inp` None: this rank's rows are in `flat` already. `counted`: as all_gather's."""
        assert self.link is not None, "an all-gather into the parameters' layout needs a shared-memory link"
        if not counted:
            self.bytes["all_gather"] += bucket.padded_numel * flat.element_size()
        rows = rows_by_rank(full_views(flat, bucket), bucket)
        held = [flat] if inp is None else [flat, inp]
        return _done(Handle(held).add(self.link.all_gather_rows(rows, inp)), async_op)


def rows_by_rank(tensors: Sequence[Tensor | None], bucket: Bucket) -> Rows:
    """Where each rank's shard of a bucket is, in full-shape `tensors` (one per slot, None: zeros):
    for a link's collectives (fz/distributed/rows.py)."""
    rows: Rows = [[] for _ in range(bucket.shards)]
    for s, t in zip(bucket.slots, tensors):
        if t is None:
            continue
        flat = t.reshape(-1)
        for q in range(bucket.shards):
            start, stop = s.local_rows(q)
            if stop > start:
                rows[q].append((s.shard_offset, flat[start * s.row_numel:stop * s.row_numel]))
    return rows


def _regions(buf: Tensor, bucket: Bucket):
    """Per slot: (slot, [world, chunk, row_numel] view of its region in a rank-major buffer)."""
    view = buf.view(bucket.shards, bucket.shard_numel)
    for s in bucket.slots:
        yield (
            s,
            view[:, s.shard_offset : s.shard_offset + s.chunk * s.row_numel].view(bucket.shards, s.chunk, s.row_numel),
        )


def pack(tensors: Sequence[Tensor | None], bucket: Bucket, dtype: torch.dtype, device) -> Tensor:
    """Full-shape tensors (None = zeros) -> a new rank-major buffer of padded_numel."""
    pad = any(s.chunk * bucket.shards != s.rows for s in bucket.slots) or any(t is None for t in tensors)
    buf = (SCRATCH.zeros if pad else SCRATCH.empty)(bucket.padded_numel, dtype, device)
    for (s, region), t in zip(_regions(buf, bucket), tensors):
        if t is None:
            continue
        rows = t.reshape(s.rows, s.row_numel)
        q = s.rows // s.chunk
        region[:q].copy_(rows[:q * s.chunk].view(q, s.chunk, s.row_numel))
        if q < bucket.shards and s.rows > q * s.chunk:
            region[q, :s.rows - q * s.chunk].copy_(rows[q * s.chunk:])
    return buf


def unpack(buf: Tensor, bucket: Bucket) -> list[Tensor]:
    """A rank-major buffer -> one new full-shape tensor per slot."""
    out = []
    for s, region in _regions(buf, bucket):
        out.append(region.reshape(bucket.shards * s.chunk, s.row_numel)[:s.rows].reshape(s.shape))
    return out


def unpack_into(buf: Tensor, bucket: Bucket, full_flat: Tensor) -> None:
    """A rank-major buffer -> copied into the bucket's full (param-major) flat buffer."""
    for s, region in _regions(buf, bucket):
        rows = full_flat[s.full_offset:s.full_offset + s.numel].view(s.rows, s.row_numel)
        q = s.rows // s.chunk
        rows[:q * s.chunk].view(q, s.chunk, s.row_numel).copy_(region[:q])
        if q < bucket.shards and s.rows > q * s.chunk:
            rows[q * s.chunk:].copy_(region[q, :s.rows - q * s.chunk])


def full_views(flat: Tensor, bucket: Bucket) -> list[Tensor]:
    """Each parameter as a view of the bucket's full flat buffer."""
    return [flat[s.full_offset:s.full_offset + s.numel].view(s.shape) for s in bucket.slots]


def shard_views(flat: Tensor, bucket: Bucket, rank: int) -> list[Tensor]:
    """Each parameter's local Shard(0) rows as a view of a per-rank shard buffer."""
    out = []
    for s in bucket.slots:
        start, stop = s.local_rows(rank)
        n = (stop - start) * s.row_numel
        out.append(flat[s.shard_offset:s.shard_offset + n].view(s.local_shape(rank)))
    return out


def local_rows_of_full(flat: Tensor, bucket: Bucket, rank: int) -> list[Tensor]:
    """Each parameter's local Shard(0) rows as a view of the full flat buffer."""
    out = []
    for s, full in zip(bucket.slots, full_views(flat, bucket)):
        start, stop = s.local_rows(rank)
        out.append(full.reshape(s.rows, *s.shape[1:])[start:stop])
    return out
