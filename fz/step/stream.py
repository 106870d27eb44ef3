"""The optimizer update with offloaded state: on the host, or streamed from disk group by group.

Host tier: the gradients come to the host, the optimizer runs there on the local shards
(torch's fused CPU AdamW) and only the updated parameters go back. On a CPU-only machine
host and device are one memory and every copy below is a no-op; the path still runs.

Disk tier: the clip norm is taken first over the gradients (in memory). Then each group
of a bucket's parameters (fp32 master rows and optimizer tensors, one aligned range of
the bucket's file) is read into a reusable buffer while earlier groups update, updated by
the same transformation with the same arguments, cast into the parameters and written
back. Where it is written depends on whether the step owns its input (donation):

- donated (the default): back where it was read, in the same file. The disk tier then
  needs its own size and nothing more (a 1 TB disk holds nearly 1 TB of state); the input
  state is consumed either way, and a step that fails midway says so (restore the last
  checkpoint), as it did when the step deleted each old file once read;
- `donate=False`: to a NEW file, so the input state's files stay whole and both states
  stay usable; such a step needs the tier's size free once more, checked before it writes.

Resident memory for the offloaded state is the pool's buffers, whatever the model's size.
"""
from __future__ import annotations

import functools
import shutil
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch.utils._pytree as pytree
from torch import Tensor

from fz.errors import ConfigError
from fz.offload.move import PART_ALIGN, _round, group_slots, master_slot_views
from fz.optim.base import global_norm, step_casting
from fz.optim.transforms import scale_to_max_norm
from fz.sharding.opt_state import merge_opt_states
from fz.step.pending import join_inflight, start_inflight
from fz.step.update import GradNorms, norm_sq_fn, shard_sum_fn
from fz.storage.disk import DiskTensor
from fz.storage.gate import Gate
from fz.storage.scratch import SCRATCH
from fz.storage.store import ALIGN, store_for

Params = dict[str, Tensor]


def _no_global_norm(tree):
    raise ConfigError("fz.offload.nvme: the optimizer computes a global norm inside its update (e.g. "
                      "clip_by_global_norm in the chain); with the optimizer state on disk the update streams "
                      "group by group and cannot see every gradient at once. Clip with Spec(clip_grad_norm=...)")


def _param_key(path) -> str | None:
    return next((e.key for e in reversed(path) if isinstance(e, pytree.MappingKey)), None)


def _subtree(tree: Any, names: set[str], every: set[str], replace: dict[int, Tensor]) -> Any:
    """The optimizer state restricted to `names`: dicts keyed by parameter keep only those keys,
    DiskTensors become their loaded buffer views, shared scalars are copied (each group owns its copy)."""
    if isinstance(tree, dict):
        keyed = any(k in every for k in tree)
        return {k: _subtree(v, names, every, replace) for k, v in tree.items() if not keyed or k in names}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_subtree(v, names, every, replace) for v in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_subtree(v, names, every, replace) for v in tree)
    if isinstance(tree, Tensor):
        return replace.get(id(tree), tree)
    return tree


def _scalars_copied(tree: Any, every: set[str]) -> Any:
    """Tensors outside parameter-keyed dicts (step counts, the lr) copied: every group updates its own."""
    if isinstance(tree, dict):
        keyed = any(k in every for k in tree)
        return tree if keyed else {k: _scalars_copied(v, every) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_scalars_copied(v, every) for v in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_scalars_copied(v, every) for v in tree)
    return tree.clone() if isinstance(tree, Tensor) else tree


class _Group:
    """One aligned range of a bucket's file: the parts of consecutive parameters."""

    def __init__(self, b, lo: int, hi: int, parts: list[list[DiskTensor]], names: list[str]):
        self.bucket, self.lo, self.hi, self.parts, self.names = b, lo, hi, parts, names
        self.blob = parts[0][0]._blob
        offs = [p._extents[0][0] for row in parts for p in row]
        self.start = min(offs)
        end = max(p._extents[0][0] + p._extents[0][1] for row in parts for p in row)
        self.length = _round(end - self.start, ALIGN)

    def views(self, buf: Tensor) -> list[list[Tensor]]:
        out = []
        for row in self.parts:
            out.append([buf[p._extents[0][0] - self.start:][:p.nbytes_on_disk].view(p.dtype).view(p.shape)
                        for p in row])
        return out


def _groups(plan, policy, flats, mflats, by_param) -> list[_Group]:
    buffer_bytes = int(policy.buffer_mb * 2**20)
    out = []
    for b in plan.buckets:
        if not b.trainable:
            continue
        mflat = mflats[b.index]
        masters = master_slot_views(b, mflat) if mflat is not None else [None] * len(b.slots)
        rows = [([m] if m is not None else []) + by_param.get(s.name, []) for s, m in zip(b.slots, masters)]
        if not all(isinstance(t, DiskTensor) for row in rows for t in row):
            raise ConfigError(f"fz.offload.nvme: the optimizer state of bucket {b.index} is not on disk; apply the "
                              "policy to the state first (fz.offload.nvme(path)(state))")
        sizes = [sum(_round(t.nbytes_on_disk, PART_ALIGN) for t in row) for row in rows]
        for lo, hi in group_slots(sizes, buffer_bytes, b):
            out.append(_Group(b, lo, hi, rows[lo:hi], [s.name for s in b.slots[lo:hi]]))
    return out


def disk_update(spec, policy, comm, plan, local_opt: Any, grads: Params, flats: list[Tensor],
                mflats: list[Tensor | None], sharded: set[str], donate: bool, norms: GradNorms | None = None,
                after: Callable[[], None] | None = None):
    """(new local optimizer state, grad norm, new master locals, new param locals). With
    `donate` every group is written back where it was read (the same files, no extra disk);
    without, to new files (the input's files stay whole: checked for room first).

    Where it can (`pipelined`), the first group is updated here and the rest stream on in the
    background after this returns: the new state's files are gated until written, and `after`
    runs once the update is done (at the next step's backward); else `after` runs before return."""
    join_inflight()  # the last step's update, if still streaming, is done before this one reads its files
    norm = None
    if spec.clip_grad_norm is not None:
        norm = global_norm(grads, norm_sq_fn(comm, sharded, norms))
        scale_to_max_norm(list(grads.values()), norm, spec.clip_grad_norm)
    by_path = [(p, x) for p, x in pytree.tree_flatten_with_path(local_opt)[0]]
    by_param: dict[str, list[DiskTensor]] = {}
    for path, x in by_path:
        if isinstance(x, DiskTensor) and (key := _param_key(path)) is not None:
            by_param.setdefault(key, []).append(x)
    groups = _groups(plan, policy, flats, mflats, by_param)
    store = store_for(policy.disk_path, policy.direct_io)
    new_blob = _output_files(store, plan, groups, flats, donate)
    streamer = _Streamer(spec, policy, comm, plan, store, local_opt, grads, flats, mflats, sharded, donate, groups,
                         new_blob)
    streamer.run(range(min(1, len(groups))))  # the first group here: does the optimizer need collectives?
    every = set(plan.slots())
    keyed_on_disk = all(isinstance(x, DiskTensor) for p, x in by_path
                        if isinstance(x, Tensor) and _param_key(p) is not None and _param_key(p) in every)
    if (pipelined(spec, plan, flats) and donate and len(groups) > 1 and not streamer.collective
            and keyed_on_disk):
        touched = {id(b): b for i in {g.bucket.index for g in groups}
                   for b in (new_blob[i], getattr(flats[i], "_blob", None)) if b is not None}
        gate = Gate(touched.values(), "the streamed optimizer update of the last step")
        streamer.hold(gate)
        results = list(streamer.results)  # the first group's: the thread appends the others
        start_inflight(gate, lambda: streamer.run(range(1, len(groups)), finish=True), after)
    else:
        streamer.run(range(1, len(groups)), finish=True)
        results = streamer.results
        if after is not None:
            after()
    old_disk = {pytree.keystr(p): x for p, x in by_path if isinstance(x, DiskTensor)}

    def to_new_file(path, x):  # the same place in the bucket's new file
        old = old_disk.get(pytree.keystr(path))
        if old is None:
            return x
        return DiskTensor(new_blob[_bucket_of(plan, _param_key(path))], old._extents, old.shape, old.dtype, old.device)

    # keyed leaves are on disk (their new values: the files); the shared scalars are equal in every group
    merged = {pytree.keystr(p): x for p, x in pytree.tree_flatten_with_path(merge_opt_states(results, every))[0]}
    new_opt = pytree.tree_map_with_path(lambda p, x: to_new_file(p, merged.get(pytree.keystr(p), x)), local_opt)

    def moved(i: int, m: Tensor) -> DiskTensor:  # a master flat (on disk: _groups checked) in its new file
        assert isinstance(m, DiskTensor)
        return DiskTensor(new_blob[i], m._extents, m.shape, m.dtype, m.device)

    new_m = [None if m is None else moved(i, m) for i, m in enumerate(mflats)]
    return new_opt, norm, new_m, [streamer.new_params.get(i, f) for i, f in enumerate(flats)]


def pipelined(spec, plan, flats: list[Tensor]) -> bool:
    """Whether this state's disk update can stream on after the step returns: every trainable
    bucket's parameters live in files (stage 3, params on disk), so the next forward reads them
    through the files' gates, and no bucket waits for a post-update all-gather. `Spec.offload`
    can turn it off (`pipeline=False`)."""
    if not spec.offload.pipeline:
        return False
    return all(isinstance(flats[b.index], DiskTensor) for b in plan.buckets if b.trainable)


class _Streamer:
    """The group loop of one disk update: read ahead `prefetch` groups into the pool's buffers,
    update each, write it back; a bucket's parameters are written when its last group is done."""

    def __init__(self, spec, policy, comm, plan, store, local_opt, grads, flats, mflats, sharded, donate, groups,
                 new_blob):
        self.spec, self.policy, self.plan, self.store, self.comm = spec, policy, plan, store, comm
        self.local_opt, self.grads, self.flats, self.mflats = local_opt, grads, flats, mflats
        self.donate, self.groups, self.new_blob = donate, groups, new_blob
        self.every = set(plan.slots())
        real_sum = shard_sum_fn(comm, sharded)
        self.collective = False  # whether the optimizer called shard_sum (a collective): then no background

        def shard_sum(tree):
            if self.gate is not None:  # streaming on: a collective here would race the next step's
                raise ConfigError("fz.offload.nvme: the optimizer summed across shards (a collective) in a later "
                                  "group but not in the first, so its update could not stream on safely; set "
                                  "fz.offload.nvme(..., pipeline=False)")
            self.collective = True
            return real_sum(tree)
        self.extra = dict(donate=True, norm_sq=_no_global_norm, shard_sum=shard_sum)
        self.io = store.io_pool(policy)
        self.free = list(self.io.buffers)
        self.writes: deque[tuple[Tensor, Future]] = deque()  # (buffer, its write)
        self.reads: dict[int, tuple[Tensor, Future]] = {}  # group -> (buffer, its read)
        self.params_mem: dict[int, Tensor] = {}  # bucket -> its parameter storage in memory (loaded if on disk)
        self.new_params: dict[int, Tensor] = {}
        self.results: list[Any] = []
        self.gate: Gate | None = None
        self.lock = threading.Lock()
        # writes not yet on disk per bucket: its groups, then its parameters if they live in a file
        self.left = {g.bucket.index: int(isinstance(flats[g.bucket.index], DiskTensor)) for g in groups}
        for g in groups:
            self.left[g.bucket.index] += 1

    def _take(self) -> Tensor | None:
        if not self.free and self.writes:
            buf, fut = self.writes.popleft()
            fut.result()
            self.free.append(buf)
        return self.free.pop() if self.free else None

    def _schedule(self, i: int) -> None:
        if i < len(self.groups) and i not in self.reads:
            buf = self._take()
            if buf is not None:
                g = self.groups[i]
                self.reads[i] = (buf, self.io.read(g.blob, g.start, g.length, buf))

    def _written(self, index: int) -> None:
        """One write of bucket `index` is on disk; once all are, its files' readers go on."""
        with self.lock:
            self.left[index] -= 1
            done = self.left[index] == 0 and self.gate is not None
        if done:
            self._release(index)

    def _write_done(self, index: int, write: Future) -> None:
        if write.exception() is None:  # a failed write keeps its files gated: the update fails with it
            self._written(index)

    def _release(self, index: int) -> None:
        assert self.gate is not None
        self.gate.release(self.new_blob[index])
        if isinstance(self.flats[index], DiskTensor):
            self.gate.release(self.flats[index]._blob)

    def hold(self, gate: Gate) -> None:
        """From now on the files of buckets not yet written are gated (those written are released)."""
        with self.lock:
            self.gate = gate
            done = [i for i, n in self.left.items() if n == 0]
        for index in done:
            self._release(index)

    def _params_in_memory(self, b) -> Tensor:
        """Bucket `b`'s parameter storage for the update to write into. With master weights every
        parameter's rows are cast from them, so a file's values are not read (at the 2.5B headline
        that read was a third of the step's buffered reads): pool memory, its padding zeroed as
        fz.init wrote it. fp32 parameters are their own masters: read (a file this update gates)."""
        flat = self.flats[b.index]
        if not isinstance(flat, DiskTensor):
            return flat
        if self.mflats[b.index] is None or not b.sharded_param:
            return flat.load(wait=False, pooled=True)
        mem = SCRATCH.empty(flat.numel(), flat.dtype, flat.device)
        for lo, hi in b.shard_gaps(self.plan.shard_rank):
            mem[lo:hi].zero_()
        return mem

    def run(self, which: range, finish: bool = False) -> None:
        groups, plan, policy, io = self.groups, self.plan, self.policy, self.io
        try:
            for i in which:
                g = groups[i]
                for j in range(i, i + 1 + policy.prefetch):
                    self._schedule(j)
                buf, fut = self.reads.pop(i)
                fut.result()
                b = g.bucket
                if b.index not in self.params_mem:
                    self.params_mem[b.index] = self._params_in_memory(b)
                views = g.views(buf)
                replace = {id(p): v for row, vrow in zip(g.parts, views) for p, v in zip(row, vrow)}
                pviews = plan.opt_locals(self.params_mem[b.index], None, b)[g.lo:g.hi]
                if self.mflats[b.index] is not None:  # the master part holds padding rows after the parameter's own
                    opt_params = {n: vrow[0][:pv.numel()].view(pv.shape) for n, vrow, pv in
                                  zip(g.names, views, pviews)}
                else:  # fp32 parameters are their own master: updated on the host beside their state, copied back
                    opt_params = {n: pv.to(buf.device) for n, pv in zip(g.names, pviews)}
                    if not self.comm.params_off:  # from the device (comm.d2h: "other")
                        self.comm.d2h["other"] += sum(pv.numel() * pv.element_size() for pv in pviews)
                sub = _subtree(_scalars_copied(self.local_opt, self.every), set(g.names), self.every, replace)
                # parameters in host memory are written by the update's own pass (fz/optim/kernel.py)
                cast = {n: pv for n, pv in zip(g.names, pviews) if opt_params[n] is not pv and pv.device.type == "cpu"}
                new_sub = step_casting(self.spec.optimizer, {n: self.grads.pop(n) for n in g.names}, sub, opt_params,
                                       cast, **self.extra)
                _copy_back(sub, new_sub, replace)
                for n, pv in zip(g.names, pviews):
                    if opt_params[n] is not pv and n not in cast:
                        pv.copy_(opt_params[n])
                if not self.comm.params_off:  # the updated rows went up to the device's parameters
                    self.comm.h2d["other"] += sum(pv.numel() * pv.element_size() for pv in pviews)
                self.results.append(new_sub)
                write = io.write(self.new_blob[b.index], g.start, g.length, buf)
                write.add_done_callback(functools.partial(self._write_done, b.index))
                self.writes.append((buf, write))
                if i + 1 == len(groups) or groups[i + 1].bucket is not b:  # the bucket is done: params leave memory
                    self.new_params[b.index] = _params_out(self.store, plan, b.index, self.flats[b.index],
                                                           self.params_mem.pop(b.index), self.donate)
                    if isinstance(self.flats[b.index], DiskTensor):
                        self._written(b.index)
            if finish:
                while self.writes:
                    buf, fut = self.writes.popleft()
                    fut.result()
                    self.free.append(buf)
        except BaseException:
            finish = True
            raise
        finally:
            if finish:
                for _buf, fut in list(self.reads.values()) + list(self.writes):
                    fut.exception()  # in-flight I/O finishes before its buffer is reused


def _output_files(store, plan, groups: list[_Group], flats: list[Tensor], donate: bool) -> dict[int, Any]:
    """{bucket: the file its updated optimizer state goes to}: its own file when the step owns it;
    else a new one, after checking the disk has room for every new file (nothing written yet)."""
    out: dict[int, Any] = {}
    for g in groups:
        out.setdefault(g.bucket.index, g.blob)
    if donate:
        return out
    need = sum(blob.nbytes for blob in out.values())
    need += sum(f.nbytes_on_disk for f in (flats[i] for i in out) if isinstance(f, DiskTensor))
    free = shutil.disk_usage(store.dir).free
    if need > free:
        raise ConfigError(f"fz.train_step(donate=False): the new state's offloaded values go to new files beside the "
                          f"input's (which stays whole) and need {need / 2**30:.2f} GiB on {store.root}; "
                          f"{free / 2**30:.2f} GiB are free. Donate the state (the default: the update is written "
                          "in place) or free space")
    for i, blob in out.items():
        out[i] = store.new_blob(f"opt-rank{plan.rank}-b{i}", blob.nbytes)
        out[i].group_bytes = blob.group_bytes
    return out


def _params_out(store, plan, index: int, old: Tensor, values: Tensor, donate: bool) -> Tensor:
    """A bucket's updated parameters: written back to its file if they live on disk (to a new
    file unless the step owns the old one); in memory they were updated in place."""
    if not isinstance(old, DiskTensor):
        return old
    if donate:
        old.store(values, wait=False)  # this update holds the file's gate
        return old
    d = DiskTensor(store.new_blob(f"param-rank{plan.rank}-b{index}", old.nbytes_on_disk), ((0, old.nbytes_on_disk),),
                   old.shape, old.dtype, old.device)
    d.store(values)
    return d


def _bucket_of(plan, name: str) -> int:
    return plan.slots()[name][0].index


def _copy_back(sub: Any, new_sub: Any, replace: dict[int, Tensor]) -> None:
    """Results a transformation returned in new tensors go into the group's buffer views."""
    views = {id(v) for v in replace.values()}
    olds, _ = pytree.tree_flatten(sub)
    news, _ = pytree.tree_flatten(new_sub)
    for o, n in zip(olds, news):
        if isinstance(o, Tensor) and id(o) in views and n is not o:
            o.copy_(n)
