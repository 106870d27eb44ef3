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


def plan_report(found: list, budgets: Budgets, start: tuple[str, str] | None = None,
                checkpoints: int | None = None) -> str:
    """The budgets (and any note on them), the precision it starts at (`start`: the precision and
    why) and what each estimate counts and leaves out, each rung's needs and verdict, the chosen
    Spec and its DeepSpeed JSON (`checkpoints`: the blocks it checkpoints), with what that JSON
    cannot turn on by itself."""
    if budgets.device is None:  # device is host
        kind = f"{budgets.host / GB:.2f} GB memory (device = host: no device budget given and no GPU here)"
    else:
        kind = f"{budgets.device / GB:.2f} GB per device, {budgets.host / GB:.2f} GB per host"
    est0 = found[0].estimate
    lines = [f"fz plan: {est0.num_params / 1e6:,.1f}M parameters, {est0.world_size} rank(s) on {est0.nodes} node(s); "
             f"budget {kind}, {budgets.disk / GB:.2f} GB free disk"]
    lines += [f"  note: {n}" for n in budgets.notes]
    if start is not None:
        lines.append(f"  precision: {start[0]} ({start[1]})")
    lines += _counted(est0, budgets)
    for c in found:
        e = c.estimate
        need = f"device {e.per_device / GB:.2f} GB, host {e.per_host / GB:.2f} GB, disk {e.per_disk / GB:.2f} GB"
        verdict = "fits" if c.fits else "rejected: " + "; ".join(c.problems)
        lines.append(f"  {c.name:<50} {need}: {verdict}")
    chosen = found[-1]
    if chosen.fits:
        lines += ["chosen:", f"  {chosen.name}", f"  {_uses(chosen.estimate, budgets)}", "",
                  "spec = " + spec_python(chosen.spec), "",
                  "DeepSpeed config:", deepspeed_json(chosen.spec, chosen.estimate.world_size, checkpoints=checkpoints)]
        if chosen.spec.micro_batch is None:  # DeepSpeed refuses a config without one
            lines.append(NO_BATCH)
        if chosen.spec.activation_checkpointing:
            lines.append(CHECKPOINTING)
    else:
        lines.append("nothing fits")
    return "\n".join(lines)


NO_BATCH = ("(it sets no batch size, as the plan was given none: add \"train_micro_batch_size_per_gpu\" (DeepSpeed "
            "refuses a config without one), or \"auto\" under Hugging Face's Trainer, which fills it; --micro-batch "
            "sets one, and with --model its activations are traced)")
CHECKPOINTING = (
    'activation checkpointing: the "activation_checkpointing" section configures DeepSpeed\'s checkpointing but does '
    "not turn it on. With Hugging Face's Trainer pass TrainingArguments(gradient_checkpointing=True) (fz.hf reads it "
    "too); in a DeepSpeed engine script the model calls deepspeed.checkpointing.checkpoint on its blocks; fz "
    "(Spec.from_deepspeed, fz.deepspeed) turns it on from the section alone.")


def _counted(e: Estimate, budgets: Budgets) -> list[str]:
    """What every rung's estimate counts, and what it leaves out."""
    states = "parameters, gradients, " + ("fp32 master weights, " if e.precision != "fp32" else "") + \
        "the optimizer's state, buffers, stage-3 gathers, reductions and offload tiers (fz.estimate)"
    rest = ("the CUDA context and " if budgets.device is not None else "") + "the allocator's cached memory " \
        "(the margin)"
    if e.activations is None:
        return [f"  counted: {states}",
                "  not counted: activations (no batch shape given: --micro-batch and --seq-len, or micro_batch= and "
                f"seq_len= / batch=, trace one micro-batch); {rest}"]
    return [f"  counted: {states}, and the activations of one traced micro-batch", f"  not counted: {rest}"]


def _uses(e: Estimate, budgets: Budgets) -> str:
    """The chosen rung's needs against the whole budgets."""
    disk = f", disk {e.per_disk / GB:.2f} GB per node" if e.per_disk else ""
    if budgets.device is None:  # device is host
        return f"uses {e.ranks_per_node * (e.per_device + e.per_rank_host) / GB:.2f} GB of " \
               f"{budgets.host / GB:.2f} GB memory{disk}"
    return f"uses device {e.per_device / GB:.2f} GB of {budgets.device / GB:.2f} GB, host " \
           f"{e.per_host / GB:.2f} GB of {budgets.host / GB:.2f} GB{disk}"
