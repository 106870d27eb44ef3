"""`fz.estimate_table`: DeepSpeed's estimator table (per CPU | per GPU | options), from fz's accounting.

DeepSpeed's `estimate_zero3_model_states_mem_needs_all_live` prints one row per offload and
zero_init option; this prints the same layout for every stage, offload tier and zero_init,
each row an `fz.estimate` (bf16 mixed precision and Adam by default, as DeepSpeed assumes).
"per CPU" is one node's host memory (every local rank's host tier, I/O buffers and, with
zero_init=0, its fp32 model copy); "per GPU" is one device's peak during a step (model
states, stage-3 gathers, reductions, the update's fp32 gradients; activations when a batch
shape is given); NVMe rows add the bytes on disk per node. Rows DeepSpeed's own estimators
cover (ZeRO-2 and ZeRO-3, nothing or the CPU offloaded, 16-bit) end with DeepSpeed's figures for
the same counts, so the two tables need not be laid side by side by hand; `str(fz.estimate(...))`
(`fz estimate --stage`) splits one row into DeepSpeed's terms and fz's extras.
"""
from __future__ import annotations

from typing import Any

from fz.offload.policy import Offload, cpu, nvme
from fz.planning.beside import deepspeed_figures
from fz.planning.counts import model_counts
from fz.planning.estimate import Estimate
from fz.planning.estimator import estimate
from fz.spec import Spec

GB = 2**30


def options(stage: int, path: str) -> list[tuple[str, Offload | None]]:
    """(DeepSpeed's option text, the fz policy) for each offload choice valid at `stage`."""
    out: list[tuple[str, Offload | None]] = []
    if stage == 3:
        out += [("offload_param=nvme, offload_optimizer=nvme", nvme(path, params=True)),
                ("offload_param=cpu , offload_optimizer=cpu ", cpu(params=True))]
    if stage >= 1:
        out += [("offload_param=none, offload_optimizer=nvme", nvme(path)),
                ("offload_param=none, offload_optimizer=cpu ", cpu())]
    return out + [("offload_param=none, offload_optimizer=none", None)]


def estimate_table(model_or_counts: Any, *, gpus_per_node: int = 1, nodes: int = 1, precision: str = "bf16",
                   stages: tuple[int, ...] = (3, 2, 1, 0), spec: Spec | None = None, nvme_path: str = "nvme",
                   micro_batch: int | None = None, seq_len: int | None = None) -> str:
    """The table as text: a row per stage x offload x zero_init (most frugal first, as DeepSpeed)."""
    counts = model_counts(model_or_counts, (spec or Spec()).wrap)
    world = gpus_per_node * nodes
    base = (spec or Spec()).replace(precision=precision)
    unit = "" if counts.largest_unit == counts.largest_layer else \
        f" ({int(counts.largest_unit / 1e6)}M in fz's largest unit)"
    lines = [
        "Estimated memory needed for params, optim states and gradients for a:",
        f"HW: Setup with {nodes} node{'s' if nodes > 1 else ''}, {gpus_per_node} GPU{'s' if gpus_per_node > 1 else ''}"
        " per node.",
        f"SW: Model with {int(counts.num_params / 1e6)}M total params, "  # rounded down, as DeepSpeed prints them
        f"{int(counts.largest_layer / 1e6)}M largest layer params{unit}; fz, {precision}, "
        f"{'activations of one micro-batch included' if micro_batch else 'no activations'}.",
        "  per CPU  |  per GPU |   Options",
    ]
    for stage in stages:
        for text, policy in options(stage, nvme_path):
            est = estimate(model_or_counts, spec=base.replace(stage=stage, offload=policy), world_size=world,
                           nodes=nodes, micro_batch=micro_batch, seq_len=seq_len, device_type="cuda")
            for zero_init in (1, 0):
                host = est.per_host + (
                    0 if zero_init else gpus_per_node * (counts.num_params * 4 + counts.buffer_bytes)
                )
                disk = f" (+{est.per_disk / GB:.2f}GB on disk per node)" if est.per_disk else ""
                lines.append(f"{host / GB:8.2f}GB | {est.per_device / GB:7.2f}GB | stage={stage}, {text}, "
                             f"zero_init={zero_init}{disk}{_deepspeed(est, policy, zero_init, gpus_per_node)}")
    return "\n".join(lines)


def _deepspeed(est: Estimate, policy: Offload | None, zero_init: int, gpus_per_node: int) -> str:
    """DeepSpeed's (per CPU, per GPU) for the row, where its estimators have one."""
    if est.stage not in (2, 3) or est.precision == "fp32" or policy is not None and "disk" in (
            policy.optimizer, policy.params):
        return ""
    cpu_mem, gpu_mem = deepspeed_figures(est.stage, est.num_params, est.largest_layer, gpus_per_node, est.nodes,
                                         policy is not None, policy is not None and policy.params == "host",
                                         bool(zero_init))
    return f"  (DeepSpeed: {cpu_mem / GB:.2f}GB, {gpu_mem / GB:.2f}GB)"
