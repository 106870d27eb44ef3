"""`memory_report`: bytes of model state on this rank, measured and as ZeRO's formula predicts.

Measured: the storage the state really holds (parameters incl. bucket padding, every
optimizer-state tensor, fp32 master weights) and the gradient buffers a step allocates
(sizes from the same bucket plan the step uses). Predicted: the ZeRO paper's
per-parameter accounting, param / grad / optimizer bytes divided by N where the
placement is Shard(0); in mixed precision params and grads take 2 bytes and the
optimizer 12 (master 4 + Adam's two moments), as in the paper's K=12.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from fz.offload.transfer import pinned_bytes
from fz.state import State, expect_state


@dataclass(frozen=True)
class MemoryReport:
    rank: int
    world: int
    stage: int
    num_params: int  # Ψ: all parameters
    num_trainable: int
    params: int  # measured bytes
    grads: int
    opt: int
    formula_params: float  # ZeRO formula bytes
    formula_grads: float
    formula_opt: float
    padding: int  # bytes of rows added so every rank's shard has the same size
    opt_other: int  # optimizer scalars (step counts): not part of ZeRO's accounting
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)  # {device|host|disk: {kind: bytes}}
    device_peak: int = 0  # torch.cuda.max_memory_allocated on the state's device since the last reset (0 off CUDA)
    pinned: int = 0  # host memory fz holds pinned for transfers in this process (fz/offload/transfer.py)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.opt

    @property
    def formula_total(self) -> float:
        return self.formula_params + self.formula_grads + self.formula_opt

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total, "formula_total": self.formula_total}

    def summary(self) -> str:
        """One line: where this rank's model states live, by tier (what a run says as it starts)."""
        tiers = {t: sum(kinds.values()) for t, kinds in self.tiers.items()} or {"device": self.total}
        where = ", ".join(f"{t} {b / 2**20:.2f} MiB" for t, b in tiers.items() if b)
        return f"ZeRO stage {self.stage} over {self.world} ranks; this rank's model states: {where or 'none'}"

    def __str__(self) -> str:
        mb = lambda x: f"{x / 2**20:10.2f}"  # noqa: E731
        rows = [("params", self.params, self.formula_params), ("grads", self.grads, self.formula_grads),
                ("optimizer", self.opt, self.formula_opt), ("total", self.total, self.formula_total)]
        lines = [f"fz memory, rank {self.rank}/{self.world}, ZeRO stage {self.stage}, "
                 f"Ψ={self.num_params:,} ({self.num_trainable:,} trainable); MiB",
                 f"{'':10} {'measured':>10} {'formula':>10}"]
        lines += [f"{name:10} {mb(m)} {mb(f)}" for name, m, f in rows]
        lines.append(f"(bucket padding: {self.padding:,} bytes)")
        if self.device_peak or self.pinned:
            lines.append(f"device peak (max_memory_allocated) {self.device_peak / 2**20:.2f} MiB, "
                         f"pinned host buffers {self.pinned / 2**20:.2f} MiB")
        if set(self.tiers) - {"device"}:
            for tier, kinds in self.tiers.items():
                parts = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in kinds.items() if v)
                lines.append(f"{tier:>10}: {parts or '-'} MiB")
        return "\n".join(lines)


def _bytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _opt_leaves_per_param(state: State) -> dict[str, int]:
    """How many param-shaped optimizer tensors each parameter has (Adam: 2)."""
    counts: dict[str, int] = {}
    for path, leaf in pytree.tree_flatten_with_path(state.opt_state)[0]:
        if isinstance(leaf, DTensor):
            key = next(e.key for e in reversed(path) if isinstance(e, pytree.MappingKey))
            counts[key] = counts.get(key, 0) + 1
    return counts


def memory_report(state: State) -> MemoryReport:
    """Per-rank bytes of this state's model states; local (shapes only: it never waits or communicates).
    N in the formulas is the shard group's size (the world size on a 1-D mesh)."""
    expect_state(state, "fz.memory_report")
    plan, n = state.plan, state.plan.shards
    opt_counts = _opt_leaves_per_param(state)
    flats = [f._local_tensor for f in state.param_flats]
    params = sum(_bytes(f) for f in flats)
    master_el = 4 if state.master_flats else 0  # fp32 master weights count with the optimizer
    grads = opt = 0
    f_params = f_grads = f_opt = 0.0
    num = trainable = padding = 0
    for b, flat in zip(plan.buckets, flats):
        el = flat.element_size()
        if b.trainable:
            grads += (b.shard_numel if isinstance(b.place.grad, Shard) and n > 1 else b.full_numel) * el
        for s in b.slots:
            pad = (s.chunk * n - s.rows) * s.row_numel * el // n
            sharded = [b.sharded_param, b.trainable and isinstance(b.place.grad, Shard),
                       b.trainable and isinstance(b.place.opt, Shard)]
            opt_pad = (s.chunk * n - s.rows) * s.row_numel * (opt_counts.get(s.name, 0) * 4 + master_el) // n
            padding += pad * (sharded[0] + sharded[1]) + opt_pad * sharded[2]
            num += s.numel
            f_params += s.numel * el / (n if b.sharded_param else 1)
            if b.trainable:
                trainable += s.numel
                f_grads += s.numel * el / (n if isinstance(b.place.grad, Shard) else 1)
                f_opt += (
                    (opt_counts.get(s.name, 0) * 4 + master_el) * s.numel / (n if isinstance(b.place.opt, Shard) else 1)
                )
    other = 0
    for leaf in pytree.tree_leaves((state.opt_state, state.master_flats)):
        if isinstance(leaf, DTensor):
            opt += _bytes(leaf._local_tensor)
        elif isinstance(leaf, Tensor):
            other += _bytes(leaf)
    return MemoryReport(plan.rank, n, state.spec.stage, num, trainable, params, grads, opt,
                        f_params, f_grads, f_opt, padding, other, _tiers(state, grads), device_peak(plan.device),
                        pinned_bytes())


def device_peak(device: torch.device) -> int:
    """Peak bytes the caching allocator handed out on `device` (torch.cuda.max_memory_allocated;
    0 off CUDA, where host and device are one memory: the process's peak RSS says it)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.max_memory_allocated(device)


def _tiers(state: State, grads: int) -> dict[str, dict[str, int]]:
    """Bytes per tier and kind: where each leaf lives (a DiskTensor: on disk; the policy's host
    tier: host memory; else the device). Buffers stay on the device; gradients too, unless the
    optimizer state is offloaded: then the step keeps them as fp32 host buffers (fz/offload/host_grads.py)."""
    from fz.offload.host_grads import host_grad_bytes
    from fz.storage.disk import DiskTensor
    policy = state.spec.offload if state.spec.offload is not None and state.spec.offload.active else None
    out: dict[str, dict[str, int]] = {t: {k: 0 for k in ("params", "master", "moments", "grads", "buffers")}
                                      for t in ("device", "host", "disk")}

    def add(kind: str, t: Tensor, policy_tier: str) -> None:
        tier = "disk" if isinstance(t, DiskTensor) else ("host" if policy_tier == "host" else "device")
        out[tier][kind] += _bytes(t)

    for f in state.param_flats:
        add("params", f._local_tensor, policy.params if policy else "device")
    for f in state.master_flats.values():
        add("master", f._local_tensor, policy.optimizer if policy else "device")
    for leaf in pytree.tree_leaves(state.opt_state):
        if isinstance(leaf, DTensor):
            add("moments", leaf._local_tensor, policy.optimizer if policy else "device")
    if policy is not None and policy.optimizer != "device":
        out["host"]["grads"] = host_grad_bytes(state.plan.buckets, state.plan.shards)
    else:
        out["device"]["grads"] = grads
    out["device"]["buffers"] = sum(_bytes(b) for b in state.buffers.values())
    if policy is not None and "disk" in (policy.optimizer, policy.params):
        out["host"]["io_buffers"] = policy.buffers * int(policy.buffer_mb * 2**20)
        blobs = {id(t._blob): t._blob for t in _disk_leaves(state)}
        out["host"]["checksums"] = sum(b.sums.table_bytes for b in blobs.values())  # fz/storage/checksum.py
    return out


def _disk_leaves(state: State) -> list:
    from fz.storage.disk import DiskTensor
    leaves = [f._local_tensor for f in state.param_flats] + [f._local_tensor for f in state.master_flats.values()]
    leaves += [x._local_tensor for x in pytree.tree_leaves(state.opt_state) if isinstance(x, DTensor)]
    return [t for t in leaves if isinstance(t, DiskTensor)]
