"""The optimizer update with offloaded state: on the host, or streamed from disk group by group.

Host tier: the gradients come to the host, the optimizer runs there on the local shards
(torch's fused CPU AdamW) and only the updated parameters go back. On a CPU-only machine
host and device are one memory and every copy below is a no-op; the path still runs.

Disk tier: the clip norm is taken first over the gradients (in memory). Then each group
of a bucket's parameters (fp32 master rows and optimizer tensors, one aligned range of
the bucket's file) is read into a reusable buffer while earlier groups update, updated by
the same transformation with the same arguments, cast into the parameters and written
to a NEW file. The old state's files are never touched, so a step that fails midway
leaves them whole; the new state's leaves name the new files. Resident memory for the
offloaded state is the pool's buffers, whatever the model's size.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from fz.errors import ConfigError
from fz.offload.move import PART_ALIGN, _round, group_slots, master_slot_views
from fz.optim.base import global_norm
from fz.optim.transforms import scale_to_max_norm
from fz.sharding.opt_state import merge_opt_states
from fz.step.update import GradNorms, apply_optimizer, norm_sq_fn, shard_sum_fn
from fz.storage.disk import DiskTensor, load
from fz.storage.store import ALIGN, store_for

Params = dict[str, Tensor]


def host_update(spec, comm, local_opt: Any, grads: Params, params: Params, sharded: set[str],
                norms: GradNorms | None = None):
    """The optimizer on the host: gradients (and fp32 parameters without master weights) copied
    there and back; a no-op copy on a CPU-only machine."""
    host = torch.device("cpu")
    grads = {k: g.to(host, non_blocking=True) for k, g in grads.items()}
    on_host = {k: p.to(host) for k, p in params.items()}
    new_opt, norm = apply_optimizer(spec, comm, local_opt, grads, on_host, sharded, norms)  # norms of the same values
    for k, p in params.items():
        if on_host[k] is not p:
            p.copy_(on_host[k], non_blocking=True)
    return new_opt, norm


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
                mflats: list[Tensor | None], sharded: set[str], donate: bool, norms: GradNorms | None = None):
    """(new local optimizer state, grad norm, new master locals, new param locals): every
    offloaded tensor of the result lives in new files. With `donate`, each old file is
    deleted as soon as its last group has been read (disk use stays near one copy)."""
    norm = None
    if spec.clip_grad_norm is not None:
        norm = global_norm(grads, norm_sq_fn(comm, sharded, norms))
        scale_to_max_norm(list(grads.values()), norm, spec.clip_grad_norm)
    extra = dict(donate=True, norm_sq=_no_global_norm, shard_sum=shard_sum_fn(comm, sharded))
    by_path = [(p, x) for p, x in pytree.tree_flatten_with_path(local_opt)[0]]
    by_param: dict[str, list[DiskTensor]] = {}
    for path, x in by_path:
        if isinstance(x, DiskTensor) and (key := _param_key(path)) is not None:
            by_param.setdefault(key, []).append(x)
    groups = _groups(plan, policy, flats, mflats, by_param)
    store = store_for(policy.disk_path, policy.direct_io)
    io = store.io_pool(policy)
    new_blob = {}
    for g in groups:
        if g.bucket.index not in new_blob:
            new_blob[g.bucket.index] = store.new_blob(f"opt-rank{plan.rank}-b{g.bucket.index}", g.blob.nbytes)
            new_blob[g.bucket.index].group_bytes = g.blob.group_bytes
    every = set(plan.slots())
    params_mem: dict[int, Tensor] = {}  # bucket -> its parameter storage in memory (loaded if on disk)
    new_params: dict[int, Tensor] = {}
    results: list[Any] = []
    free = list(io.buffers)
    writes: deque[tuple[Tensor, Future]] = deque()  # (buffer, its write)
    reads: dict[int, tuple[Tensor, Future]] = {}  # group -> (buffer, its read)

    def take() -> Tensor | None:
        if not free and writes:
            buf, fut = writes.popleft()
            fut.result()
            free.append(buf)
        return free.pop() if free else None

    def schedule(i: int) -> None:
        if i < len(groups) and i not in reads:
            buf = take()
            if buf is not None:
                reads[i] = (buf, io.read(groups[i].blob, groups[i].start, groups[i].length, buf))

    try:
        for i, g in enumerate(groups):
            for j in range(i, i + 1 + policy.prefetch):
                schedule(j)
            buf, fut = reads.pop(i)
            fut.result()
            b = g.bucket
            if donate and (i + 1 == len(groups) or groups[i + 1].blob is not g.blob):
                g.blob.remove_now()
            if b.index not in params_mem:
                params_mem[b.index] = load(flats[b.index])
                if donate and isinstance(flats[b.index], DiskTensor):
                    flats[b.index]._blob.remove_now()
            views = g.views(buf)
            replace = {id(p): v for row, vrow in zip(g.parts, views) for p, v in zip(row, vrow)}
            pviews = plan.opt_locals(params_mem[b.index], None, b)[g.lo:g.hi]
            master = mflats[b.index] is not None
            if master:  # the master part holds padding rows after the parameter's own
                opt_params = {n: vrow[0][:pv.numel()].view(pv.shape) for n, vrow, pv in zip(g.names, views, pviews)}
            else:  # fp32 parameters are their own master: updated on the host beside their state, copied back
                opt_params = {n: pv.to(buf.device) for n, pv in zip(g.names, pviews)}
            sub = _subtree(_scalars_copied(local_opt, every), set(g.names), every, replace)
            new_sub = spec.optimizer.step({n: grads.pop(n) for n in g.names}, sub, opt_params, **extra)
            _copy_back(sub, new_sub, replace)
            for n, pv in zip(g.names, pviews):
                if opt_params[n] is not pv:
                    pv.copy_(opt_params[n])
            results.append(new_sub)
            writes.append((buf, io.write(new_blob[b.index], g.start, g.length, buf)))
            if i + 1 == len(groups) or groups[i + 1].bucket is not b:  # the bucket is done: its params leave memory
                new_params[b.index] = _params_out(store, plan, b.index, flats[b.index], params_mem.pop(b.index))
        while writes:
            buf, fut = writes.popleft()
            fut.result()
            free.append(buf)
    finally:
        for _buf, fut in list(reads.values()) + list(writes):
            fut.exception()  # in-flight I/O finishes before its buffer is reused
    old_disk = {pytree.keystr(p): x for p, x in by_path if isinstance(x, DiskTensor)}

    def to_new_file(path, x):  # the same place in the bucket's new file
        old = old_disk.get(pytree.keystr(path))
        if old is None:
            return x
        return DiskTensor(new_blob[_bucket_of(plan, _param_key(path))], old._extents, old.shape, old.dtype, old.device)

    merged = {pytree.keystr(p): x for p, x in pytree.tree_flatten_with_path(merge_opt_states(results, every))[0]}
    new_opt = pytree.tree_map_with_path(lambda p, x: to_new_file(p, merged.get(pytree.keystr(p), x)), local_opt)

    def moved(i: int, m: Tensor) -> DiskTensor:  # a master flat (on disk: _groups checked) in its new file
        assert isinstance(m, DiskTensor)
        return DiskTensor(new_blob[i], m._extents, m.shape, m.dtype, m.device)

    new_m = [None if m is None else moved(i, m) for i, m in enumerate(mflats)]
    return new_opt, norm, new_m, [new_params.get(i, f) for i, f in enumerate(flats)]


def _params_out(store, plan, index: int, old: Tensor, values: Tensor) -> Tensor:
    """A bucket's updated parameters: written to a new file if they live on disk (else updated in place)."""
    if not isinstance(old, DiskTensor):
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
