"""Text for `fz plan`: each rung's verdict, the chosen Spec as Python, its DeepSpeed JSON (an estimate's own
text is fz/planning/estimate.py's)."""
from __future__ import annotations

from fz.config.export import deepspeed_json
from fz.offload.policy import Offload
from fz.planning.estimate import Estimate
from fz.planning.machine import Budgets
from fz.spec import Spec

GB = 2**30
SHOWN = ("stage", "precision", "activation_checkpointing", "micro_batch", "grad_accum", "clip_grad_norm",
         "shard_group_size", "bucket_mb", "persist_threshold", "live_buckets", "prefetch", "reduce_dtype")


def offload_python(policy: Offload) -> str:
    if policy.optimizer == "disk":
        extra = ", params=True" if policy.params == "disk" else ""
        return f"fz.offload.nvme({policy.path!r}{extra})"
    args = [] if policy.optimizer == "host" else ["optimizer=False"]
    args += ["params=True"] if policy.params == "host" else []
    return f"fz.offload.cpu({', '.join(args)})"


def spec_python(spec: Spec) -> str:
    """`fz.Spec(...)` with the fields that differ from the defaults; the caller's functions appear
    by name (`loss_fn=loss_fn`) and the optimizer is left out (keep yours)."""
    default = Spec()
    parts = [f"{f}={getattr(spec, f)!r}" for f in SHOWN if getattr(spec, f) != getattr(default, f)]
    if spec.offload is not None and spec.offload.active:
        parts.append(f"offload={offload_python(spec.offload)}")
    parts += [f"{f}={f}" for f in ("loss_fn", "wrap", "init_fn") if getattr(spec, f) is not None]  # your functions
    return "fz.Spec(" + ", ".join(parts) + ")"


def plan_report(found: list, budgets: Budgets) -> str:
    """The budgets (and any note on them), each rung's needs and verdict, the chosen Spec."""
    if budgets.device is None:  # device is host
        kind = f"{budgets.host / GB:.2f} GB memory (device = host: no device budget given and no GPU here)"
    else:
        kind = f"{budgets.device / GB:.2f} GB per device, {budgets.host / GB:.2f} GB per host"
    est0 = found[0].estimate
    lines = [f"fz plan: {est0.num_params / 1e6:,.1f}M parameters, {est0.world_size} rank(s) on {est0.nodes} node(s); "
             f"budget {kind}, {budgets.disk / GB:.2f} GB free disk"]
    lines += [f"  note: {n}" for n in budgets.notes]
    for c in found:
        e = c.estimate
        need = f"device {e.per_device / GB:.2f} GB, host {e.per_host / GB:.2f} GB, disk {e.per_disk / GB:.2f} GB"
        verdict = "fits" if c.fits else "rejected: " + "; ".join(c.problems)
        lines.append(f"  {c.name:<50} {need}: {verdict}")
    chosen = found[-1]
    if chosen.fits:
        lines += ["chosen:", f"  {chosen.name}", f"  {_uses(chosen.estimate, budgets)}", "",
                  "spec = " + spec_python(chosen.spec), "",
                  "DeepSpeed config:", deepspeed_json(chosen.spec, chosen.estimate.world_size)]
    else:
        lines.append("nothing fits")
    return "\n".join(lines)


def _uses(e: Estimate, budgets: Budgets) -> str:
    """The chosen rung's needs against the whole budgets."""
    disk = f", disk {e.per_disk / GB:.2f} GB per node" if e.per_disk else ""
    if budgets.device is None:  # device is host
        return f"uses {e.ranks_per_node * (e.per_device + e.per_rank_host) / GB:.2f} GB of " \
               f"{budgets.host / GB:.2f} GB memory{disk}"
    return f"uses device {e.per_device / GB:.2f} GB of {budgets.device / GB:.2f} GB, host " \
           f"{e.per_host / GB:.2f} GB of {budgets.host / GB:.2f} GB{disk}"
