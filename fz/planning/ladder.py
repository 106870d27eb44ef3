"""`fz.plan`: DeepSpeed's procedure for picking a configuration, as code.

Start with the fastest configuration and, while it does not fit, take one step toward the
most frugal (DeepSpeed's advice, each step keeping the previous ones): activation
checkpointing, ZeRO-2, + optimizer offload to the host, ZeRO-3, + parameter offload to the
host, lower precision (bf16; a GPU plan starts there), then NVMe for the optimizer state and
the parameters. Each
candidate is checked with `fz.estimate` against the budgets less a safety margin (the
estimate counts live bytes; the allocator keeps some freed memory, measured 5-20% on glibc),
and the disk tier needs its bytes free, as `fz.init` requires (a step updates it in place).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from torch import nn

from fz.errors import ConfigError
from fz.log import logger
from fz.offload.policy import cpu, nvme
from fz.planning.counts import model_counts
from fz.planning.estimator import Estimate, estimate
from fz.planning.machine import Budgets, local_devices, plan_budgets
from fz.planning.render import plan_report
from fz.spec import Spec
from fz.step.runner import _wants_checkpoint

GB = 2**30


def rungs(base: Spec, nvme_path: str, activations: bool = True) -> list[tuple[str, Spec]]:
    """The ladder from fastest to most frugal; each rung keeps the previous rungs' changes.
    Without `activations` (no batch shape to trace) checkpointing has nothing to show for itself."""
    steps: list[tuple[str, Callable[[Spec], Spec]]] = [
        ("ZeRO-0 (data parallel)", lambda s: s.replace(stage=0, offload=None)),
        ("+ activation checkpointing", lambda s: s.replace(activation_checkpointing=True)),
        ("ZeRO-2", lambda s: s.replace(stage=2)),
        ("ZeRO-2 + optimizer offload (host)", lambda s: s.replace(offload=cpu())),
        ("ZeRO-3 + optimizer offload (host)", lambda s: s.replace(stage=3)),
        ("ZeRO-3 + optimizer and parameter offload (host)", lambda s: s.replace(offload=cpu(params=True))),
        ("+ bf16 mixed precision", lambda s: s.replace(precision="bf16") if s.precision == "fp32" else s),
        ("ZeRO-3 + optimizer and parameter offload (NVMe)", lambda s: s.replace(offload=nvme(nvme_path, params=True))),
    ]
    out: list[tuple[str, Spec]] = []
    spec = base
    for name, step in steps:
        if name.startswith("+ activation") and not activations:
            continue
        nxt = step(spec)
        if nxt != spec or not out:  # a rung that changes nothing (bf16 already) is not a step
            spec = nxt
            out.append((name, spec))
    return out


def start_precision(base: Spec, precision: str | None, budgets: Budgets) -> tuple[str, str]:
    """(the precision the ladder starts at, why): `precision` if given, else the Spec's when not
    fp32, else bf16 for a GPU plan (a device budget, or a GPU here: mixed precision is what a
    GPU trains in) and fp32 for a CPU one."""
    if precision is not None:
        return precision, "as given"
    if base.precision != "fp32":
        return base.precision, "the Spec's"
    if budgets.device is not None:
        return "bf16", "the default for a GPU plan; --precision fp32 (precision='fp32') plans full precision"
    return "fp32", "the default for a CPU plan; --precision bf16 (precision='bf16') plans mixed precision"


def checkpointed(model: Any, spec: Spec) -> int | None:
    """How many blocks `spec` checkpoints in `model` (None: raw counts, or none checkpointed)."""
    if not spec.activation_checkpointing or not isinstance(model, nn.Module):
        return None
    units = model_counts(model, spec.wrap).unit_names[1:]
    return sum(_wants_checkpoint(spec.activation_checkpointing, n, model.get_submodule(n)) for n in units) or None


@dataclass(frozen=True)
class Candidate:
    name: str
    spec: Spec
    estimate: Estimate
    problems: tuple[str, ...]  # empty: it fits

    @property
    def fits(self) -> bool:
        return not self.problems


def check(est: Estimate, budgets: Budgets, margin: float) -> tuple[str, ...]:
    """Why `est` does not fit `budgets` (an empty tuple if it does), naming the budget each need exceeds."""
    usable = lambda b: b * (1 - margin)  # noqa: E731
    of = lambda b: f"{usable(b) / GB:.2f} GB ({b / GB:.2f} GB less the {margin:.0%} margin)"  # noqa: E731
    out = []
    local = est.ranks_per_node
    if budgets.device_is_host:
        need = local * (est.per_device + est.per_rank_host)
        if need > usable(budgets.host):
            out.append(f"needs {need / GB:.2f} GB of memory ({local} rank(s) x (device {est.per_device / GB:.2f} + "
                       f"host {est.per_rank_host / GB:.2f})) > {of(budgets.host)}")
    else:
        if est.per_device > usable(budgets.device):
            out.append(f"needs {est.per_device / GB:.2f} GB of device > {of(budgets.device)}")
        if est.per_host > usable(budgets.host):
            out.append(f"needs {est.per_host / GB:.2f} GB of host ({local} rank(s)) > {of(budgets.host)}")
    if est.per_disk and est.per_disk > budgets.disk:
        out.append(f"the disk tier holds {est.per_disk / GB:.2f} GB per node, {budgets.disk / GB:.2f} GB are free")
    return tuple(out)


def candidates(model: Any, *, base: Spec | None = None, world_size: int | None = None, nodes: int = 1,
               device_budget: float | None = None, host_budget: float | None = None,
               disk_budget: float | None = None, nvme_path: str = "nvme", margin: float = 0.2,
               micro_batch: int | None = None, seq_len: int | None = None, batch: Any = None,
               stop_at_first: bool = True, precision: str | None = None) -> tuple[list[Candidate], Budgets]:
    """The ladder's rungs, estimated and checked, up to the first that fits (or all of them),
    starting at `start_precision`."""
    budgets = plan_budgets(nvme_path, device_budget, host_budget, disk_budget)
    world = local_devices() * nodes if world_size is None else world_size  # 0 is refused by estimate, not 1
    base = base or Spec()
    base = base.replace(precision=start_precision(base, precision, budgets)[0])
    device_type: Literal["cuda", "cpu"] = "cpu" if budgets.device_is_host else "cuda"  # as its autocast keeps them
    if micro_batch is not None and base.micro_batch is None:  # the micro-batch planned for is the Spec's
        base = base.replace(micro_batch=micro_batch)
    out: list[Candidate] = []
    for name, spec in rungs(base, nvme_path, batch is not None or micro_batch is not None):
        est = estimate(model, spec=spec, world_size=world, nodes=nodes, micro_batch=micro_batch, seq_len=seq_len,
                       batch=batch, device_type=device_type)
        off = spec.offload
        if off is not None and off.optimizer == "disk" and est.largest_opt_part > off.buffer_mb * 2**20:
            # the disk tier streams whole parameters: its I/O buffers must hold the largest one's state
            spec = spec.replace(offload=replace(off, buffer_mb=float(-(-est.largest_opt_part // 2**20))))
            est = estimate(model, spec=spec, world_size=world, nodes=nodes, micro_batch=micro_batch,
                           seq_len=seq_len, batch=batch, device_type=device_type)
        out.append(Candidate(name, spec, est, check(est, budgets, margin)))
        if out[-1].fits and stop_at_first:
            break
    return out, budgets


def plan(model: Any, *, spec: Spec | None = None, world_size: int | None = None, nodes: int = 1,
         device_budget: float | None = None, host_budget: float | None = None,
         disk_budget: float | None = None, nvme_path: str = "nvme", margin: float = 0.2,
         micro_batch: int | None = None, seq_len: int | None = None, batch: Any = None,
         report: Callable[[str], None] | None = None, precision: str | None = None) -> Spec:
    """The fastest configuration of `spec` (optimizer, loss, batch...) that fits the budgets, in
    bytes (defaults: this machine's GPU memory, RAM and the free disk under `nvme_path`). A device
    budget plans for that device, GPU here or not; with none and no GPU the device is the host.
    The ladder starts at `precision`, else the Spec's unless fp32, else bf16 for a GPU plan.
    `report` (e.g. print) receives the budgets, the precision and what was counted, why each
    faster rung was rejected, the Spec as Python and its DeepSpeed JSON; without it, notes on
    the budgets go to the log."""
    if not 0 <= margin < 1:
        raise ConfigError(f"fz.plan: margin={margin!r} must be in [0, 1) (the fraction of each budget kept free)")
    found, budgets = candidates(model, base=spec, world_size=world_size, nodes=nodes, device_budget=device_budget,
                                host_budget=host_budget, disk_budget=disk_budget, nvme_path=nvme_path,
                                margin=margin, micro_batch=micro_batch, seq_len=seq_len, batch=batch,
                                precision=precision)
    if report is not None:
        start = start_precision(spec or Spec(), precision, budgets)
        report(plan_report(found, budgets, start, checkpointed(model, found[-1].spec)))
    else:
        for note in budgets.notes:
            logger("planning").warning("fz.plan: %s", note)
    if not found[-1].fits:
        last = found[-1]
        raise ConfigError(f"fz.plan: no configuration fits; the most frugal ({last.name}) "
                          f"{'; '.join(last.problems)}. Use more devices or nodes (world_size=, nodes=), a smaller "
                          "micro-batch, or a larger disk for the NVMe tier (nvme_path=)")
    return found[-1].spec
