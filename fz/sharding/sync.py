"""Stages 1 and 2: replicated parameters arriving after a sharded update, as leaf-level futures.

Each rank's optimizer updates only its rows, so after the step every rank all-gathers
the buckets. Waiting for that at the end of the step would leave the network idle
during compute and the cores idle during the transfer; instead the all-gathers run
while the next step's forward computes (DeepSpeed and FSDP do the same with their
prefetch). Every one of them is started at the end of the step, on every rank: so a
read of the state on one rank only waits for work already under way and never starts a
collective of its own (a bounded pipeline would have to, and could hang).

The gathers land in the parameters' own storage (as DeepSpeed's flat buffer), not in a
second full-size one: the bucket's flat buffer is given up to the step (its old values are
not read again: this rank's updated rows are copied out first) and viewed rank-major as the
gather's output. Ranks that share memory (fz/distributed/shm.py) write each rank's rows
straight to their place; otherwise, when it arrives, a bucket whose rank-major and
parameter-major layouts differ (several parameters, or rows split unevenly) is reordered
through one bucket-sized scratch buffer at a time. Only where padding makes the gathered bucket larger than the
parameters' storage does a bucket get a buffer of its own. What stays alive until the next
forward is each bucket's local rows (the gather's input): 1/N of the parameters.

The returned State holds such a bucket as an `Arriving` tensor: like a JAX array under
async dispatch, it is a future of its values. Views of it (the parameters by name, a
DTensor around it) are futures too; anything that reads its data waits for that bucket
first; the next step takes the real storage and waits bucket by bucket, just before each
block runs. Flattening, printing or mapping a state over its shapes never waits and never
starts a collective: the all-gathers were started by every rank at the end of the step.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.distributed.tensor import Shard

from fz.sharding.buckets import Bucket
from fz.sharding.comm import Comm, local_rows_of_full, shard_views, unpack_into
from fz.sharding.settle import Handle

aten = torch.ops.aten
# ops that only make a view (the result is still arriving) or read no data (nothing to wait for)
_VIEWS = {aten.view.default, aten.slice.Tensor, aten.as_strided.default, aten.alias.default,
          aten._reshape_alias.default, aten.detach.default, aten.unsqueeze.default, aten.squeeze.dim,
          aten.select.int, aten.split.Tensor, aten.split_with_sizes.default, aten.expand.default}
_SHAPE_ONLY = {aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
               aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
               aten.empty_strided.default, aten.new_empty_strided.default}


class ParamSync:
    """The all-gathers of one step's updated rows, in bucket order (the same on every rank)."""

    def __init__(self, comm: Comm, shard_rank: int, todo: Sequence[tuple[Bucket, Tensor, Tensor | None]]):
        self.comm, self.rank = comm, shard_rank
        # (bucket, flat, the gather's output (None: flat, in place), (work, its input))
        self.inflight: list[tuple[Bucket, Tensor, Tensor | None, tuple[Handle, Tensor | None]]] = []
        self.waiting = {b.index for b, _, _ in todo}  # buckets not up to date yet
        for b, flat, mflat in todo:  # the bytes belong to the step that made the update
            comm.bytes["all_gather"] += b.padded_numel * flat.element_size()
            self._launch(b, flat, mflat)

    def _launch(self, b: Bucket, flat: Tensor, mflat: Tensor | None) -> None:
        shard: Tensor | None = None
        if mflat is not None:  # this rank's updated rows, in the parameters' dtype, where the parameters live
            shard = mflat.to(flat.device, flat.dtype)
            count_cast(self.comm, shard, mflat)
        if self.comm.link is not None and flat.is_contiguous():  # ranks sharing memory write in place
            # (without masters this rank's rows are in place already: the link reads them there)
            work = self.comm.all_gather_params(flat, shard, b, async_op=True, counted=True)
            self.inflight.append((b, flat, None, (work, shard)))
            return
        if shard is None:
            shard = torch.empty(b.shard_numel, dtype=flat.dtype, device=flat.device)
            for lo, hi in b.shard_gaps(self.rank):
                shard[lo:hi].zero_()
            for dst, src in zip(shard_views(shard, b, self.rank), local_rows_of_full(flat, b, self.rank)):
                dst.copy_(src)
        # the parameters' own storage, when the gathered bucket fits it (no padding)
        full = flat if b.padded_numel == flat.numel() and flat.is_contiguous() else \
            torch.empty(b.padded_numel, dtype=flat.dtype, device=flat.device)
        work = self.comm.all_gather(full, shard, async_op=True, counted=True)
        self.inflight.append((b, flat, full, (work, shard)))

    def _complete_oldest(self) -> None:
        b, flat, full, (work, shard) = self.inflight.pop(0)
        work.wait()  # the gather's input (`shard`) goes with this entry
        if full is not None and full is not flat:  # (None: gathered in the parameters' layout)
            unpack_into(full, b, flat)
        elif full is flat and not rank_major_is_param_major(b):
            unpack_into(full.clone(), b, flat)  # one bucket's scratch, freed at once
        self.waiting.discard(b.index)

    def wait(self, index: int) -> None:
        """Bucket `index` is up to date when this returns (earlier buckets too: collectives finish
        in order). A bucket this sync does not gather (a frozen one) returns at once."""
        while index in self.waiting:
            self._complete_oldest()

    def finish(self) -> None:
        while self.waiting:
            self._complete_oldest()

    @property
    def pending(self) -> bool:
        return bool(self.waiting)


def rank_major_is_param_major(b: Bucket) -> bool:
    """True when the gathered (rank-major) bucket already is the parameters' layout: one
    parameter whose rows split evenly over the ranks."""
    return len(b.slots) == 1 and b.slots[0].chunk * b.shards == b.slots[0].rows


class Arriving(torch.Tensor):
    """A bucket's storage (or a view of it) whose values arrive with `sync`'s all-gather."""

    _data: Tensor
    _sync: ParamSync
    _index: int

    @staticmethod
    def __new__(cls, data: Tensor, sync: ParamSync, index: int) -> Arriving:
        r = torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                                storage_offset=data.storage_offset(), dtype=data.dtype,
                                                device=data.device, requires_grad=False)
        r._data, r._sync, r._index = data, sync, index
        return r

    def result(self) -> Tensor:
        """The values, once this bucket has arrived (waits for it)."""
        self._sync.wait(self._index)
        return self._data

    def __repr__(self) -> str:  # type: ignore[override]  # torch: Tensor.__repr__(tensor_contents=) is untyped
        state = "arriving" if self._index in self._sync.waiting else "arrived"
        return f"Arriving(shape={tuple(self.shape)}, dtype={self.dtype}, {state})"

    def __deepcopy__(self, memo) -> Tensor:
        return self.result().clone()

    def __reduce_ex__(self, proto):
        return self.result().__reduce_ex__(proto)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        futures = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, Arriving)]
        if func in _SHAPE_ONLY:
            unwrapped = pytree.tree_map(lambda x: x._data if isinstance(x, Arriving) else x, (args, kwargs))
            return func(*unwrapped[0], **unwrapped[1])
        if func in _VIEWS and any(a._index in a._sync.waiting for a in futures):
            unwrapped = pytree.tree_map(lambda x: x._data if isinstance(x, Arriving) else x, (args, kwargs))
            out = func(*unwrapped[0], **unwrapped[1])
            first = futures[0]
            return pytree.tree_map(lambda t: Arriving(t, first._sync, first._index) if isinstance(t, Tensor) else t,
                                   out)
        unwrapped = pytree.tree_map(lambda x: x.result() if isinstance(x, Arriving) else x, (args, kwargs))
        return func(*unwrapped[0], **unwrapped[1])


def local_data(t: Tensor) -> tuple[Tensor, ParamSync | None]:
    """(the storage, the sync it still waits for or None) of a bucket's local tensor."""
    if isinstance(t, Arriving):
        return t._data, (t._sync if t._index in t._sync.waiting else None)
    return t, None


def gathered(plan, b: Bucket) -> bool:
    """Whether bucket `b`'s parameters come back by an all-gather after the update (a replicated
    parameter updated in shards); else from the masters by a cast in place, in the same layout."""
    return not b.sharded_param and isinstance(b.place.opt, Shard) and plan.shards > 1


def start_param_sync(comm: Comm, plan, flats: Sequence[Tensor],
                     mflats: Sequence[Tensor | None]) -> ParamSync | None:
    """Make every rank's parameters equal the updated (master) shards: a cast copy where the
    layouts agree (done now), an all-gather where a replicated parameter was updated in
    shards (returned as a ParamSync that runs during the next forward; None if there is none)."""
    todo = []
    for b, flat, mflat in zip(plan.buckets, flats, mflats):  # (a bucket's masters live with the optimizer state)
        if not b.trainable:
            continue
        if gathered(plan, b):
            todo.append((b, flat, mflat))
        elif mflat is not None:
            flat.copy_(mflat)  # same layout: a cast copy
            count_cast(comm, flat, mflat)
    return ParamSync(comm, plan.shard_rank, todo) if todo else None


def count_cast(comm: Comm, cast: Tensor, master: Tensor) -> None:
    """The cast copy from the masters into the parameters (`cast`: the result) crosses between
    host and device where the optimizer state and the parameters live in different tiers: up
    (the host update's parameters going back), in the parameters' dtype (a blocking copy_ to
    CUDA casts on the host first), or down (masters on the device, parameters offloaded), in
    the masters' (it casts on the host after)."""
    if comm.opt_off and not comm.params_off:
        comm.h2d["other"] += cast.numel() * cast.element_size()
    elif comm.params_off and not comm.opt_off:
        comm.d2h["other"] += master.numel() * master.element_size()
