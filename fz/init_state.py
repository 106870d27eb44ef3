"""`fz.init`: a model and a Spec in, the sharded training State out."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.nn as nn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from fz.background import raise_background_failures
from fz.ckpt.hf.pretrained import fill, resolve
from fz.distributed import peers
from fz.errors import ConfigError
from fz.model.leaves import fetches_root
from fz.model.materialize import InitialValues, module_seed
from fz.model.signature import signature
from fz.model.skeleton import bucket_entries, build_skeleton
from fz.offload.host_grads import reserve_host_grads
from fz.offload.move import bucket_init_on_disk, check_room_at_init, host_tree, param_to_disk
from fz.offload.transfer import pool_for
from fz.optim import kernel
from fz.optim.aliases import takes_host_kernel
from fz.optim.transforms import current_lr
from fz.rng import seeded
from fz.sharding.buckets import Bucket, make_buckets
from fz.sharding.comm import Comm, connect, full_views, pack
from fz.sharding.mesh import make_mesh
from fz.sharding.opt_state import merge_opt_states, wrap_opt_state
from fz.sharding.plan import ShardPlan
from fz.sharding.replicated import check_replicated
from fz.spec import Spec
from fz.state import State
from fz.step.metrics import initial_metrics
from fz.step.scaler import init_scaler


def init(model: nn.Module, spec: Spec, *, mesh: DeviceMesh | None = None,
         weights: str | os.PathLike[str] | None = None, allow_nonfinite: bool = False) -> State:
    """Shard `model`'s parameters as `spec` says and create the optimizer state.

    `model` is not modified. Built on the meta device, it is initialised module by module
    with seeds from (spec.seed, module name); built normally, its values are used, taken
    from the mesh's first rank so every rank starts alike (as DDP does). A tensor meta init
    leaves unset, or a replicated value that differs between ranks, is a ConfigError naming
    it. `mesh` is a 1-D mesh, or a 2-D one with dims ("replicate", "shard") for hybrid
    sharding (by default fz makes one over every rank, 2-D when `spec.shard_group_size` is set).
    `weights` (a safetensors file or Hugging Face folder) gives the values instead, as
    fz.load_weights reads them: a NaN or inf among them is fz.NonFiniteError naming the tensors
    (`allow_nonfinite=True`: a warning with the counts).
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"fz.init needs an nn.Module, got {type(model).__name__}")
    if not isinstance(spec, Spec):
        raise ConfigError(f"fz.init needs an fz.Spec, got {type(spec).__name__}")
    raise_background_failures()
    peers.doing("fz.init")
    mesh = make_mesh(mesh, spec.shard_group_size, timedelta(seconds=spec.timeout_s))
    peers.configure(spec.timeout_s)
    device = (
        torch.device(mesh.device_type, torch.cuda.current_device())
        if mesh.device_type == "cuda"
        else torch.device("cpu")
    )
    skel = build_skeleton(model, spec.wrap, fetches_root(spec))

    for n, p in model.named_parameters():
        if p.dtype != torch.float32:
            raise ConfigError(f"parameter {n!r} is {p.dtype}; fz keeps fp32 parameters (precision is set in the Spec)")
    entries = bucket_entries(model, skel)  # every parameter frozen: an inference State (apply, eval_step, generate)
    shards = mesh.size(mesh.ndim - 1)
    buckets = make_buckets(entries, spec.stage, shards, int(spec.bucket_mb * 2**20 / 4), spec.persist_threshold)
    plan = ShardPlan.build(mesh, device, tuple(buckets))
    offload = spec.offload if spec.offload is not None and spec.offload.active else None
    host_casts = device.type == "cpu" or (offload is not None and offload.params != "device"
                                          and offload.optimizer != "device")
    if spec.precision != "fp32" and host_casts and takes_host_kernel(spec.optimizer):
        kernel.prepare()  # the host update's kernel compiles while the state is built (fz/optim/kernel.py)
    check_replicated(plan, signature(spec, model), _DISAGREE)  # before any collective depends on them
    connect(plan)  # ranks of one host share memory for their collectives (a collective itself)
    comm = Comm(plan)
    source = None
    if weights is not None:  # names and shapes checked before anything is allocated or written
        source = resolve(weights, plan, skel, dict(model.named_buffers(remove_duplicate=True)), strict=True)

    disk_policy = spec.offload if spec.offload is not None and spec.offload.optimizer == "disk" else None
    if spec.offload is not None:
        check_room_at_init(spec.offload, plan, spec.optimizer, spec.precision != "fp32")
    values = InitialValues(model, spec.seed, device, spec.init_fn)
    # what the policy puts on the host is made there bucket by bucket: the device never holds
    # the whole optimizer state (or, params offloaded, every shard) it is about to give away
    host_opt = spec.offload is not None and spec.offload.optimizer == "host"
    host_params = spec.offload is not None and spec.offload.params == "host"
    pin = spec.offload is not None and spec.offload.pin_memory
    storages, on_disk = [], []
    for b in buckets:
        flat, mflat = (_bucket_storage(model, plan, comm, b, spec, values) if source is None
                       else _zero_storage(plan, b, spec))
        if host_params and b.sharded_param:
            flat = host_tree(flat, pin)
        if host_opt and mflat is not None:
            mflat = host_tree(mflat, pin)
        if disk_policy is not None and b.trainable:  # straight to disk, one bucket at a time
            local = spec.optimizer.init(dict(zip((s.name for s in b.slots), plan.opt_locals(flat, mflat, b))))
            mflat, opt_b = bucket_init_on_disk(disk_policy, plan, b, mflat, local)
            on_disk.append(opt_b)
        if spec.offload is not None and spec.offload.params == "disk" and b.sharded_param:
            flat = param_to_disk(spec.offload, plan, b, flat)
        storages.append((flat, mflat))
    param_flats = tuple(plan.wrap_flat(p, b, b.place.param) for b, (p, _) in zip(buckets, storages))
    master_flats = {b.index: plan.wrap_flat(m, b, b.place.opt) for b, (_, m) in zip(buckets, storages) if m is not None}
    buffer_names = [n for n, _ in model.named_buffers(remove_duplicate=True)]
    buffers = values(buffer_names)
    values.check()  # nothing meta init left unset
    replicated = {f"parameter {s.name!r}": v for b, (p, _) in zip(buckets, storages) if not b.sharded_param
                  for s, v in zip(b.slots, full_views(p, b))} if source is None else {}  # else: all read one file
    check_replicated(plan, dict(replicated, **{f"buffer {n!r}": t for n, t in buffers.items()}))

    if disk_policy is not None:
        opt_state = merge_opt_states(on_disk, {s.name for b in buckets for s in b.slots})
    else:
        opt_params: dict[str, Tensor] = {}
        for b, (flat, mflat) in zip(buckets, storages):
            if b.trainable:
                locals_ = plan.opt_locals(flat, mflat, b)
                opt_params.update(zip((s.name for s in b.slots), (t.cpu() if host_opt else t for t in locals_)))
        # host_tree takes the optimizer's fresh state over: pinned tensor by tensor, never two copies
        opt_state = wrap_opt_state(host_tree(spec.optimizer.init(opt_params), pin) if host_opt
                                   else spec.optimizer.init(opt_params), plan)

    if host_opt and device.type == "cuda" and offload is not None:
        # pinning is slow: the step's fp32 host gradients are pinned now, not by the first step
        reserve_host_grads(pool_for(offload), buckets, plan.shards)
    rng = seeded(module_seed(spec.seed, f"rank{plan.rank}"), plan.device)
    scaler = init_scaler(spec)
    try:
        lr = current_lr(opt_state)
    except ValueError:
        lr = None
    metrics = initial_metrics(lr, float(scaler.get("scale", 1.0)))
    state = State(step=torch.zeros((), dtype=torch.int64), param_flats=param_flats, master_flats=master_flats,
                  opt_state=opt_state, scaler=scaler, rng=rng, buffers=buffers, data={}, metrics=metrics,
                  skeleton=skel, spec=spec, plan=plan)
    state = spec.offload(state) if spec.offload is not None and spec.offload.active else state
    if source is not None:
        fill(state, *source, allow_nonfinite=allow_nonfinite, who="fz.init")
    return state


_DISAGREE = ("thing(s) differ between ranks (the spec or the model): every rank must build the same model "
             "and pass the same Spec", "Build the model and the Spec the same way on every rank (only an offload "
             "path may differ).")


def _zero_storage(plan: ShardPlan, b: Bucket, spec: Spec) -> tuple[Tensor, Tensor | None]:
    """A bucket's storage laid out as `_bucket_storage` lays it out, zeroed (padding rows stay
    zero): the values come from a weights file, so the model's init is never run."""
    n = b.shard_numel if b.sharded_param else b.full_numel
    param = torch.zeros(n, dtype=spec.compute_dtype, device=plan.device)
    if spec.precision == "fp32" or not b.trainable:
        return param, None
    m = b.shard_numel if isinstance(b.place.opt, Shard) else b.full_numel
    return param, torch.zeros(m, dtype=torch.float32, device=plan.device)


def _bucket_storage(model: nn.Module, plan: ShardPlan, comm: Comm, b: Bucket, spec: Spec,
                    initial: InitialValues) -> tuple[Tensor, Tensor | None]:
    """This rank's (param storage, fp32 master storage or None) for bucket `b`, initialised.

    Params are in the compute dtype, laid out by their placement (full or this rank's
    padded rows); master weights exist in mixed precision only, laid out by the
    optimizer's placement.
    """
    values = initial([s.name for s in b.slots])
    full = torch.cat([values[s.name].reshape(-1) for s in b.slots])
    names = {s.name for s in b.slots}
    if any(not p.is_meta for n, p in model.named_parameters() if n in names):
        comm.broadcast_first(full)

    def rows() -> Tensor:
        rank_major = pack(full_views(full, b), b, full.dtype, full.device)
        return rank_major.view(plan.shards, b.shard_numel)[plan.shard_rank].clone()

    param = rows() if b.sharded_param else full
    if spec.precision == "fp32" or not b.trainable:
        return param.to(spec.compute_dtype), None
    master = (param if b.sharded_param else rows()) if isinstance(b.place.opt, Shard) else full
    return param.to(spec.compute_dtype), master
