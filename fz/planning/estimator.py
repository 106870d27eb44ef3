"""`fz.estimate`: bytes per device, per host and on disk of a configuration, before running it.

Model states come from the accounting `fz.memory_report` measures, computed from the same
pieces: the bucket plan `fz.init` would build (`make_buckets`, so the padding is the same),
parameters in the compute dtype, fp32 master weights in mixed precision, the optimizer's
own state from a meta-device run of its `init` on this rank's rows, and the offload
policy's tiers. On top of that, what only exists during a step: the gathered buckets of
stage 3 (`live_buckets` of them), reduction buffers in flight, the disk tier's I/O buffers,
gradients as the optimizer reads them (fp32), and activations traced from one micro-batch
(fz/planning/activations.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, cast

import torch
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from fz.distributed.group import device_type as training_device
from fz.errors import ConfigError
from fz.model.leaves import fetches_root
from fz.offload.host_grads import MAX_COPIES, host_grad_bytes
from fz.offload.move import PART_ALIGN, opt_file_bytes
from fz.offload.policy import Offload
from fz.planning.activations import default_batch, trace
from fz.planning.buffers import link_bytes, pool_idle
from fz.planning.counts import ModelCounts, model_counts
from fz.planning.estimate import KINDS, Estimate
from fz.precision import PRECISIONS
from fz.sharding.buckets import Bucket, make_buckets
from fz.sharding.opt_state import _param_key, is_placed_leaf
from fz.sharding.plan import ShardPlan
from fz.spec import Spec
from fz.step.grads import MAX_INFLIGHT
from fz.step.runner import _wants_checkpoint, keep_budget
from fz.storage.checksum import table_bytes


def _rank_plan(buckets: Sequence[Bucket], world: int, shards: int, rank: int = 0) -> ShardPlan:
    """A plan without a process group: enough for the layout helpers (rank 0 of shard group 0)."""
    no_mesh = cast(DeviceMesh, None)  # no process group: the layout helpers never read the mesh
    return ShardPlan(no_mesh, torch.device("cpu"), tuple(buckets), rank, tuple(range(world)), rank,
                     tuple(range(shards)), world // shards, None, None)


def _opt_bytes(spec: Spec, plan: ShardPlan, b: Bucket, mixed: bool, el_dtype: torch.dtype) -> tuple[int, list[int]]:
    """Bytes of the optimizer state memory_report counts (leaves placed like their parameter),
    and each parameter's part on the disk tier (its master rows and leaves, aligned as
    fz/offload/move.py writes them: one part must fit one I/O buffer)."""
    flat = torch.empty(b.shard_numel if b.sharded_param else b.full_numel, dtype=el_dtype, device="meta")
    mflat = torch.empty(b.shard_numel if isinstance(b.place.opt, Shard) else b.full_numel, device="meta") \
        if mixed else None
    views = dict(zip((s.name for s in b.slots), plan.opt_locals(flat, mflat, b)))
    tree = spec.optimizer.init(views)
    total = 0
    sharded = isinstance(b.place.opt, Shard)
    parts = {s.name: _aligned((s.chunk * s.row_numel if sharded else s.numel) * 4) if mixed else 0 for s in b.slots}
    for path, leaf in pytree.tree_flatten_with_path(tree)[0]:
        key = _param_key(path)
        if isinstance(leaf, torch.Tensor) and key in views and \
                is_placed_leaf(path, leaf, views[key].shape, sharded):
            total += leaf.numel() * leaf.element_size()
            parts[key] += _aligned(leaf.numel() * leaf.element_size())
    return total, list(parts.values())


def _aligned(n: int) -> int:
    return -(-n // PART_ALIGN) * PART_ALIGN


def estimate(model_or_counts: Any, *, world_size: int = 1, nodes: int = 1, stage: int | None = None,
             precision: str | None = None, offload: Any = "spec", shard_group_size: int | None = None,
             micro_batch: int | None = None, seq_len: int | None = None,
             activation_checkpointing: Any = None, spec: Spec | None = None, batch: Any = None,
             zero_init: bool | None = None, device_type: Literal["cuda", "cpu"] | None = None) -> Estimate:
    """Bytes per device, per host and on disk of training `model_or_counts` (an nn.Module, best
    built on the meta device, or raw counts `(total_params, largest_layer)`) as `spec` says, with
    the keywords overriding it. Activations are traced from one micro-batch when `batch` (shapes
    only) or `micro_batch` and `seq_len` (token ids) are given. `zero_init`: the model is built on
    the meta device (default: True unless `model_or_counts` is a module with real values).
    `device_type`: the device the activations are traced for, as its autocast keeps them (default:
    the one fz trains on here, "cuda" where a GPU is visible, else "cpu")."""
    spec = spec or Spec()
    changes = dict(stage=stage, precision=precision, shard_group_size=shard_group_size,
                   activation_checkpointing=activation_checkpointing)
    changes = {k: v for k, v in changes.items() if v is not None}
    if offload != "spec":
        changes["offload"] = offload
    spec = spec.replace(**changes)
    if device_type not in (None, "cuda", "cpu"):
        raise ConfigError(f"fz.estimate: device_type={device_type!r}: the activations are traced for \"cuda\" or "
                          f"\"cpu\" (None: the device fz trains on here)")
    if not isinstance(world_size, int) or world_size < 1 or not isinstance(nodes, int) or nodes < 1 \
            or world_size % nodes:
        raise ConfigError(f"fz.estimate: world_size={world_size!r} must be a positive multiple of nodes={nodes!r}")
    shards = spec.shard_group_size or world_size
    if world_size % shards:
        raise ConfigError(f"fz.estimate: shard_group_size={shards} does not divide world_size={world_size}")
    counts = model_counts(model_or_counts, spec.wrap, fetches_root(spec))
    buckets = make_buckets(counts.entries, spec.stage, shards, int(spec.bucket_mb * 2**20 / 4), spec.persist_threshold)
    plan = _rank_plan(buckets, world_size, shards)
    dtype, mixed = spec.compute_dtype, spec.precision != "fp32"
    el = torch.empty((), dtype=dtype).element_size()
    policy = spec.offload if spec.offload is not None and spec.offload.active else None
    tiers = {t: dict.fromkeys(KINDS, 0) for t in ("device", "host", "disk")}
    params = grads = master = opt = largest_part = sums = 0
    for b in buckets:
        p = (b.shard_numel if b.sharded_param else b.full_numel) * el
        tier = policy.params if policy else "device"
        tiers["device" if tier == "disk" and not b.sharded_param else tier]["params"] += p
        params += p
        sums += table_bytes(p) if tier == "disk" and b.sharded_param else 0  # the file's checksums
        if not b.trainable:
            continue
        grads += (b.shard_numel if isinstance(b.place.grad, Shard) and shards > 1 else b.full_numel) * el
        m = (b.shard_numel if isinstance(b.place.opt, Shard) else b.full_numel) * 4 if mixed else 0
        o, parts = _opt_bytes(spec, plan, b, mixed, dtype)
        largest_part = max([largest_part, *parts])
        tier = policy.optimizer if policy else "device"
        if policy and tier == "disk":
            sums += table_bytes(opt_file_bytes(parts, int(policy.buffer_mb * 2**20)))
        tiers[tier]["master"] += m
        tiers[tier]["moments"] += o
        master, opt = master + m, opt + o
    host_grads = policy is not None and policy.optimizer != "device"  # fz/offload/host_grads.py
    if host_grads:
        tiers["host"]["grads"] = host_grad_bytes(buckets, shards)
    else:
        tiers["device"]["grads"] = grads
    tiers["device"]["buffers"] = counts.buffer_bytes
    io = policy.buffers * int(policy.buffer_mb * 2**20) if policy and "disk" in (policy.optimizer, policy.params) else 0
    if io:
        tiers["host"]["io_buffers"] = io
    if sums:
        tiers["host"]["checksums"] = sums
    g = _gather(spec, buckets, el, counts, shards, params_off=policy is not None and policy.params == "host")
    update = (0, 0) if host_grads else _grads_update(buckets, el, mixed, shards, spec)
    traced_for = device_type or training_device()
    return Estimate(
        world_size,
        nodes,
        spec.stage,
        spec.precision,
        counts.num_params,
        params,
        grads,
        master,
        opt,
        counts.buffer_bytes,
        sum(g),
        _reduce(spec, buckets, shards, el, host_grads),
        update[0] + update[1],
        _sync(buckets, el, shards),
        io,
        *_activations(counts, spec, buckets, el, shards, batch, micro_batch, seq_len, traced_for),
        _model_copy(counts, zero_init),
        tiers,
        world_size // nodes,
        largest_part,
        _update_loaded(policy, buckets, el),
        g.summed,
        0 if host_grads else _accumulated(buckets, el, shards, spec),
        *(pool_idle(spec, buckets, el, policy) if io and policy else (0, 0)),
        link_bytes(buckets, shards),
        g.root,
        g.unit,
        g.kept,
        update[1],
        counts.largest_layer,
        counts.largest_unit,
        (policy.optimizer, policy.params) if policy else ("device", "device"),
        traced_for if batch is not None or micro_batch is not None else None,
    )


class Gathered(NamedTuple):
    """The parts of stage 3's gathered bytes (`Estimate.gather` is their sum): what the estimate
    beside DeepSpeed's names one by one (fz/planning/beside.py)."""

    root: int  # the root's own buckets, gathered for the whole step (root not fetched per use)
    unit: int  # the largest unit, gathered while it runs
    prefetched: int  # the rest of the units in flight beside it (`prefetch`, over several ranks)
    kept: int  # units `live_buckets` keeps from forward to backward
    summed: int  # the summed gradient of a bucket several units gather (a tied embedding and head); in
    # forward the same bucket's parameters, held from its first use to its last (never both at once)


def _gather(spec: Spec, buckets: Sequence[Bucket], el: int, counts: ModelCounts, shards: int,
            params_off: bool = False) -> Gathered:
    """Stage 3 (fz/step/runner.py): the root's own gathered buckets, held for the whole step;
    the units in flight: the running one and, over several ranks, the `prefetch` ones after it
    in call order (taken as the model's order; all of a unit's buckets at once), counted as the
    largest unit and the rest of the worst window (which holds at least the largest unit); the
    units `live_buckets` keeps from forward to backward (at most as many as the buckets it
    leaves room for; the largest, to be safe); the gradient of a bucket several units gather (a
    tied embedding and head), held from its first use's backward to its last (fz/sharding/uses.py),
    the size of its parameters, which forward holds from their first use to their last.
    At one rank each parameter is copied once to the device, whatever tier its shard is in, and
    only shards in host memory are prefetched (their uploads; `params_off`; a shard on disk is
    read ahead instead)."""
    sharded = [b for b in buckets if b.sharded_param]
    root = [b for b in sharded if b.unit == 0]
    units: dict[int, list] = {}  # unit -> the buckets it gathers (a shared bucket for each of its users)
    summed = 0
    for b in sharded:
        users = {b.unit, *(u for s in b.slots for u in counts.shared.get(s.name, ()))} - {0}
        for u in users:
            units.setdefault(u, []).append(b)
        summed += b.full_numel if b.trainable and len(users) > 1 else 0
    sizes = [sum(b.full_numel for b in units[u]) for u in sorted(units)]
    running = 1 + (spec.prefetch if shards > 1 or params_off else 0)  # one rank prefetches uploads only
    window = max((sum(sizes[i:i + running]) for i in range(len(sizes))), default=0)
    widest = max((len(bs) for bs in units.values()), default=0)
    kept = max(0, keep_budget(spec.live_buckets, spec.prefetch, len(root), widest, counts.fetches_root))
    unit = max(sizes, default=0)
    return Gathered(sum(b.full_numel for b in root) * el, unit * el, (window - unit) * el,
                    sum(sorted(sizes, reverse=True)[:kept]) * el, summed * el)


def _reduce(spec: Spec, buckets: Sequence[Bucket], shards: int, el: int, host_grads: bool) -> int:
    """Gradient buffers of the buckets being reduced (at most MAX_INFLIGHT at once), in the reduce
    dtype: a packed full bucket and its shard when sharded, the bucket's full gradient otherwise
    (autograd sums its parameters' gradients into one bucket-sized buffer). With gradients going
    to the host, the results waiting for their copy (MAX_COPIES) too; on one rank nothing is
    reduced: the buffers are the gradients themselves, in the parameters' dtype."""
    rb = PRECISIONS[spec.reduce_dtype or "fp32"].itemsize if shards > 1 else el
    trainable = [b for b in buckets if b.trainable]
    if shards > 1 and spec.stage > 0:
        sizes = [b.padded_numel + b.shard_numel for b in trainable]
        copies = [b.shard_numel for b in trainable]
    else:
        sizes = copies = [b.full_numel for b in trainable]
    # one rank, gradients to the host: nothing to reduce, each bucket's gradient is copied at once
    inflight = 0 if host_grads and shards == 1 else sum(sorted(sizes, reverse=True)[:MAX_INFLIGHT])
    if host_grads:
        inflight += sum(sorted(copies, reverse=True)[:MAX_COPIES])
    return inflight * rb


def _grads_update(buckets: Sequence[Bucket], el: int, mixed: bool, shards: int, spec: Spec) -> tuple[int, int]:
    """Gradients as the update holds them (this rank's rows when the optimizer state is sharded):
    the last micro-batch's sum stays in the reduce dtype when that is wider (fp32); a narrower
    sum (one rank, or a low reduce_dtype) is copied to fp32 for the optimizer beside itself.
    Returns (what the optimizer reads, the narrower sum kept beside it: 0 when none is)."""
    rb = PRECISIONS[spec.reduce_dtype or "fp32"].itemsize
    kept = max(el, rb) if shards > 1 else el
    n = sum(b.shard_numel if shards > 1 and (isinstance(b.place.grad, Shard) or isinstance(b.place.opt, Shard))
            else b.full_numel for b in buckets if b.trainable)
    if mixed and kept < 4:
        return n * 4, n * kept
    return n * kept, 0


def _accumulated(buckets: Sequence[Bucket], el: int, shards: int, spec: Spec) -> int:
    """Replicated gradients (stages 0-1) are summed in full, in the parameters' dtype, from one
    micro-batch to the next and reduced in the last (fz/step/grads.py): with grad_accum > 1 they
    are alive through the later micro-batches' backward. Stage 2 reduce-scatters every
    micro-batch into this rank's rows (in `grads_update`)."""
    if spec.grad_accum <= 1:
        return 0
    return sum(b.full_numel for b in buckets if b.trainable and not b.sharded_param
               and not (isinstance(b.place.grad, Shard) and shards > 1)) * el


def _sync(buckets: Sequence[Bucket], el: int, shards: int) -> int:
    """Stages 1-2 over several ranks (fz/sharding/sync.py): each replicated, sharded-optimizer
    bucket's local rows (the all-gather's input) until its gather lands in the parameters' own
    storage; a bucket that padding makes larger than that storage, a whole gathered buffer."""
    if shards == 1:
        return 0
    gathered = [b for b in buckets if b.trainable and not b.sharded_param and isinstance(b.place.opt, Shard)]
    return sum(b.shard_numel + (b.padded_numel if b.padded_numel != b.full_numel else 0) for b in gathered) * el


def _activations(counts: ModelCounts, spec: Spec, buckets: Sequence[Bucket], el: int, shards: int, batch: Any,
                 micro_batch: int | None, seq_len: int | None,
                 device_type: str) -> tuple[int | None, int | None, int | None]:
    """(activations at the forward's end, at backward's first op, at the units' backward's worst point)."""
    if batch is None and micro_batch is None:
        return None, None, None
    if counts.model is None:
        raise ConfigError("fz.estimate: activations need a model to trace (raw counts have none); "
                          "leave micro_batch/seq_len unset, or pass the model")
    if batch is None:
        if seq_len is None:
            raise ConfigError("fz.estimate: micro_batch= needs seq_len= (or pass batch= with one micro-batch)")
        assert micro_batch is not None  # batch or micro_batch: returned above otherwise
        batch = default_batch(micro_batch, seq_len)
    t = trace(counts.model, counts.unit_names, batch, spec.precision, spec.loss_fn, device_type)
    policy = spec.activation_checkpointing
    modules = {n: counts.model.get_submodule(n) for n in counts.unit_names[1:]}
    grads: dict[str, int] = {}
    for b in buckets:
        if b.trainable:
            n = b.shard_numel if isinstance(b.place.grad, Shard) and shards > 1 else b.full_numel
            grads[counts.unit_names[b.unit]] = grads.get(counts.unit_names[b.unit], 0) + n * el
    offloaded = spec.offload is not None and spec.offload.optimizer != "device"  # gradients leave as they go
    return t.peaks(lambda name: bool(policy) and _wants_checkpoint(policy, name, modules[name]), grads,
                   grads_stay=not offloaded)


def _update_loaded(policy: Offload | None, buckets: Sequence[Bucket], el: int) -> int:
    """The disk tier's update loads one bucket's parameters at a time beside the I/O buffers."""
    if policy is None or policy.params != "disk":
        return 0
    return max((b.shard_numel if b.sharded_param else b.full_numel for b in buckets if b.trainable), default=0) * el


def _model_copy(counts: ModelCounts, zero_init: bool | None) -> int:
    """A model built with real values stays in the user's hands: 4 bytes per parameter per rank."""
    if zero_init is None:
        zero_init = counts.model is None or all(p.is_meta for p in counts.model.parameters())
    return 0 if zero_init else counts.num_params * 4 + counts.buffer_bytes

