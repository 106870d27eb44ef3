"""Moving a State's leaves between tiers, and the disk layout of a bucket's optimizer state.

On disk, a bucket's optimizer state is one file per rank, laid out in groups of
consecutive parameters: for each parameter its fp32 master rows (mixed precision), then
each of its optimizer tensors (Adam's two moments). A group fits one I/O buffer and
starts on a 4 KiB boundary, so the step reads and writes it with one aligned call
(O_DIRECT). Parameter shards on disk (stage 3) are one contiguous file per bucket.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.distributed.tensor import DTensor

from fz.errors import ConfigError
from fz.offload.transfer import pinned_copy
from fz.sharding.buckets import Bucket
from fz.storage.disk import DiskTensor, load
from fz.storage.store import ALIGN, IOSettings, check_directory, store_for


class Policy(IOSettings, Protocol):
    """What moving leaves reads of a policy (fz/offload/policy.py's Offload, which applies itself
    through this module: a Protocol here, so neither file imports the other back)."""

    @property
    def optimizer(self) -> str: ...
    @property
    def params(self) -> str: ...
    @property
    def direct_io(self) -> bool: ...
    @property
    def disk_path(self) -> str: ...
    @property
    def active(self) -> bool: ...
    def check_stage(self, stage: int) -> None: ...


PART_ALIGN = 64


def _round(n: int, a: int) -> int:
    return -(-n // a) * a


def tier_of(t: Tensor, policy_tier: str) -> str:
    return "disk" if isinstance(t, DiskTensor) else ("host" if policy_tier == "host" else "device")


def opt_leaves_by_param(opt_state: Any) -> dict[str, list[tuple[Any, DTensor]]]:
    """{param name: [(path, DTensor leaf)]}: the optimizer tensors kept per parameter, in tree order."""
    out: dict[str, list[tuple[Any, DTensor]]] = {}
    for path, leaf in pytree.tree_flatten_with_path(opt_state)[0]:
        if isinstance(leaf, DTensor):
            key = next((e.key for e in reversed(path) if isinstance(e, pytree.MappingKey)), None)
            if key is not None:
                out.setdefault(key, []).append((path, leaf))
    return out


def master_slot_views(b: Bucket, mflat: Tensor) -> list[Tensor]:
    """Each parameter's part of the master storage, padding rows included (so the parts tile it)."""
    if b.place.opt.is_shard():
        return [mflat[s.shard_offset:s.shard_offset + s.chunk * s.row_numel] for s in b.slots]
    return [mflat[s.full_offset:s.full_offset + s.numel] for s in b.slots]


def group_slots(part_bytes: list[int], buffer_bytes: int, bucket: Bucket | None) -> list[tuple[int, int]]:
    """[lo, hi) slot ranges whose parts fit one buffer, in order (a part larger than one buffer is a
    ConfigError naming it; with no bucket, as for an estimate, it gets a group of its own)."""
    groups, lo, size = [], 0, 0
    for i, n in enumerate(part_bytes):
        if n > buffer_bytes and bucket is not None:
            raise ConfigError(f"fz.offload: the optimizer state of {bucket.slots[i].name!r} is {n:,} bytes on this "
                              f"rank, more than one I/O buffer ({buffer_bytes:,} bytes); raise buffer_mb")
        if size and size + n > buffer_bytes:
            groups.append((lo, i))
            lo, size = i, 0
        size += n
    groups.append((lo, len(part_bytes)))
    return groups


def opt_file_bytes(part_bytes: list[int], buffer_bytes: int, bucket: Bucket | None = None) -> int:
    """Size of a bucket's optimizer file (each slot's aligned parts): its groups in order, each
    starting at an ALIGN boundary, as write_opt_bucket lays them out."""
    total = 0
    for lo, hi in group_slots(part_bytes, buffer_bytes, bucket):
        total = _round(total + sum(part_bytes[lo:hi]), ALIGN)
    return total


def _slot_parts(plan, b: Bucket, mflat: Tensor | None, by_param) -> list[list[Tensor]]:
    masters = master_slot_views(b, mflat) if mflat is not None else [None] * len(b.slots)
    return [([m] if m is not None else []) + [leaf._local_tensor for _, leaf in by_param.get(s.name, [])]
            for s, m in zip(b.slots, masters)]


def write_opt_bucket(policy: Policy, plan, b: Bucket, parts: list[list[Tensor]]) -> list[list[DiskTensor]]:
    """Write one bucket's optimizer parts into a new file; the DiskTensors that now hold them."""
    sizes = [[_round(t.numel() * t.element_size(), PART_ALIGN) for t in ts] for ts in parts]
    groups = group_slots([sum(s) for s in sizes], int(policy.buffer_mb * 2**20), b)
    offsets: list[list[int]] = []
    at = 0
    for lo, hi in groups:
        for i in range(lo, hi):
            offsets.append([])
            for n in sizes[i]:
                offsets[-1].append(at)
                at += n
        at = _round(at, ALIGN)
    store = store_for(policy.disk_path, policy.direct_io)
    blob = store.new_blob(f"opt-rank{plan.rank}-b{b.index}", opt_file_bytes([sum(s) for s in sizes],
                                                                            int(policy.buffer_mb * 2**20), b))
    blob.group_bytes = int(policy.buffer_mb * 2**20)
    out = []
    for ts, offs in zip(parts, offsets):
        row = []
        for t, off in zip(ts, offs):
            d = DiskTensor(blob, ((off, t.numel() * t.element_size()),), t.shape, t.dtype, torch.device("cpu"))
            d.store(load(t))
            row.append(d)
        out.append(row)
    return out


def _concat(pieces: list[DiskTensor], numel: int, dtype, device) -> DiskTensor:
    extents = tuple(e for p in pieces for e in p._extents)
    return DiskTensor(pieces[0]._blob, extents, (numel,), dtype, device)


def _to_tier(t: Tensor, tier: str, device: torch.device, pin: bool) -> Tensor:
    t = load(t)
    if tier == "host":
        return pinned_copy(t) if pin else t.to("cpu")
    return t.to(device)


def _opt_on_disk(policy: Policy, b: Bucket, mflat: Tensor | None, by_param) -> bool:
    """Whether the bucket's optimizer state is already one file laid out for this policy's buffers."""
    tensors = ([mflat] if mflat is not None else []) + [
        leaf._local_tensor for s in b.slots for _, leaf in by_param.get(s.name, [])
    ]
    blobs = {t._blob for t in tensors if isinstance(t, DiskTensor)}
    return (len(blobs) == 1 and all(isinstance(t, DiskTensor) for t in tensors)
            and getattr(next(iter(blobs)), "group_bytes", None) == int(policy.buffer_mb * 2**20))


def apply_policy(policy: Policy, state):
    """`state` with every offloadable leaf in `policy`'s tier (leaves already there are kept)."""
    policy.check_stage(state.spec.stage)
    state.check_alive("an offload policy")
    plan, spec = state.plan, state.spec
    if policy.params != "device" and not state.skeleton.fetches_root and any(
            b.unit == 0 and b.sharded_param for b in plan.buckets):
        warnings.warn("fz.offload: this state's parameters leave the device, but its root (embeddings, final norm, "
                      "head) stays gathered for the whole step: the state was made without parameter offload. "
                      "fz.init with the offload in the Spec fetches those per use (fz/model/leaves.py).", stacklevel=3)
    by_param = opt_leaves_by_param(state.opt_state)
    _check_room(policy, state, by_param)
    replaced: dict[int, Tensor] = {}  # id(old local) -> new local
    masters = dict(state.master_flats)
    for b in plan.buckets:
        if not b.trainable:
            continue
        mflat = masters[b.index]._local_tensor if b.index in masters else None
        if policy.optimizer == "disk":
            if not _opt_on_disk(policy, b, mflat, by_param):
                replaced.update(_bucket_to_disk(policy, plan, b, mflat, by_param))
        else:
            for t in ([mflat] if mflat is not None else []) + [leaf._local_tensor for s in b.slots
                                                                 for _, leaf in by_param.get(s.name, [])]:
                new = _to_tier(t, policy.optimizer, plan.device, policy.pin_memory)
                if new is not t:
                    replaced[id(t)] = new

    def swap(x):
        if isinstance(x, DTensor) and id(x._local_tensor) in replaced:
            return DTensor(replaced[id(x._local_tensor)], x._spec, requires_grad=False)
        return x

    opt_state = pytree.tree_map(swap, state.opt_state)
    master_flats = {i: swap(t) for i, t in masters.items()}
    param_flats = tuple(_move_params(policy, plan, b, f, spec) for b, f in zip(plan.buckets, state.param_flats))
    return dataclasses.replace(state, opt_state=opt_state, master_flats=master_flats, param_flats=param_flats,
                               spec=spec.replace(offload=policy if policy.active else None))


def _bucket_to_disk(policy: Policy, plan, b: Bucket, mflat: Tensor | None, by_param) -> dict[int, Tensor]:
    """Write one bucket's master weights and optimizer tensors to a new file: {id(old local): DiskTensor}."""
    parts = _slot_parts(plan, b, mflat, by_param)
    disk = write_opt_bucket(policy, plan, b, parts)
    replaced: dict[int, Tensor] = {}
    skip = 1 if mflat is not None else 0
    for old, new in zip(parts, disk):
        for o, n in zip(old[skip:], new[skip:]):
            replaced[id(o)] = n
    if mflat is not None:
        replaced[id(mflat)] = _concat([row[0] for row in disk], mflat.numel(), mflat.dtype, torch.device("cpu"))
    return replaced


def bucket_init_on_disk(policy: Policy, plan, b: Bucket, mflat: Tensor | None, local_opt: Any):
    """fz.init's path for the disk tier, one bucket at a time (so the whole optimizer state is
    never in memory): (master storage on disk or None, the bucket's optimizer state on disk)."""
    from fz.sharding.opt_state import wrap_opt_state
    tree = wrap_opt_state(local_opt, plan)
    replaced = _bucket_to_disk(policy, plan, b, mflat, opt_leaves_by_param(tree))

    def swap(x):
        if isinstance(x, DTensor) and id(x._local_tensor) in replaced:
            return DTensor(replaced[id(x._local_tensor)], x._spec, requires_grad=False)
        return x

    return (replaced[id(mflat)] if mflat is not None else None), pytree.tree_map(swap, tree)


def check_room_at_init(policy: Policy, plan, optimizer, mixed: bool) -> None:
    """fz.init's check before anything is written: the bytes the disk tier will hold, from a
    meta-device run of the optimizer's init."""
    if "disk" not in (policy.optimizer, policy.params):
        return
    need = 0
    for b in plan.buckets:
        meta = torch.empty(b.shard_numel if b.sharded_param else b.full_numel, device="meta")
        if policy.params == "disk" and b.sharded_param:
            need += meta.numel() * 2
        if policy.optimizer == "disk" and b.trainable:
            opt_meta = torch.empty(b.shard_numel if b.place.opt.is_shard() else b.full_numel, device="meta")
            views = plan.opt_locals(meta, opt_meta if mixed else None, b)
            tree = optimizer.init(dict(zip((s.name for s in b.slots), views)))
            need += sum(t.numel() * 4 for t in pytree.tree_leaves(tree) if isinstance(t, Tensor) and t.is_meta)
            need += opt_meta.numel() * 4 if mixed else 0
    check_directory(policy.disk_path, need)


def _check_room(policy: Policy, state, by_param) -> None:
    """Before anything is written: the directory exists, is writable and has room for the bytes
    that will live there (a step writes its update in place: fz/step/stream.py)."""
    if "disk" not in (policy.optimizer, policy.params):
        return
    need = 0
    for b in state.plan.buckets:
        m = state.master_flats.get(b.index)
        mflat = m._local_tensor if m is not None else None
        if policy.optimizer == "disk" and b.trainable and not _opt_on_disk(policy, b, mflat, by_param):
            need += sum(
                t.numel() * t.element_size() for row in _slot_parts(state.plan, b, mflat, by_param) for t in row
            )
        local = state.param_flats[b.index]._local_tensor
        if policy.params == "disk" and b.sharded_param and not isinstance(local, DiskTensor):
            need += local.numel() * local.element_size()
    if need:
        check_directory(policy.disk_path, need)


def param_to_disk(policy: Policy, plan, b: Bucket, local: Tensor) -> DiskTensor:
    """A bucket's parameter shard written to a new file (one contiguous file per rank and bucket)."""
    store = store_for(policy.disk_path, policy.direct_io)
    blob = store.new_blob(f"param-rank{plan.rank}-b{b.index}", local.numel() * local.element_size())
    d = DiskTensor(blob, ((0, blob.nbytes),), local.shape, local.dtype, plan.device)
    d.store(local)
    return d


def _move_params(policy: Policy, plan, b: Bucket, f: DTensor, spec) -> DTensor:
    local = f._local_tensor
    if not b.sharded_param:  # replicated parameters are needed whole by every forward
        return f if not isinstance(local, DiskTensor) else DTensor(_to_tier(local, "device", plan.device, False),
                                                                    f._spec, requires_grad=False)
    if policy.params == "disk":
        return f if isinstance(local, DiskTensor) else DTensor(param_to_disk(policy, plan, b, local), f._spec,
                                                               requires_grad=False)
    new = _to_tier(local, policy.params, plan.device, policy.pin_memory)
    return f if new is local else DTensor(new, f._spec, requires_grad=False)


def host_tree(tree, pin: bool):
    """`tree`'s tensors in host memory, pinned when `pin` (and CUDA is there), converted one at a time.

    The caller hands the tree over (its last reference): each tensor is replaced as it is
    converted, so at most one extra tensor exists at once, never a second copy of the whole state."""
    leaves, spec = pytree.tree_flatten(tree)
    del tree
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, Tensor) and not isinstance(leaf, DiskTensor):
            leaves[i] = _to_tier(leaf, "host", leaf.device, pin)
    return pytree.tree_unflatten(leaves, spec)
