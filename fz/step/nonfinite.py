"""A NaN or inf never reaches the weights, in any precision: `Spec(nonfinite="skip" | "raise")`.

Where finiteness is known: after the gradient reduction each rank holds its reduced
shard (stages 1-3) or the whole reduced gradient (stage 0, identical on every rank). A
NaN or inf anywhere in any rank's gradients reaches the reduced values (a sum keeps it),
so each rank checks what it holds (with clipping on, from the gradients' norms, which the
clip needs anyway: fz/step/update.py's GradNorms; else one sum per gradient), and the
verdict needs one reduction: two slots per rank on the loss all-reduce the step runs anyway
(fz/step/agree.py: index + 1 of the first non-finite gradient, and whether the rank's own
loss is), no collective of its own.
At stage 0 (and on one rank) every rank already holds the same reduced gradients, so its
own check is the verdict and that all-reduce still runs while the optimizer does; at
stages 1-3 the update waits for it (one small all-reduce's latency).

`skip`: the optimizer does not run, so parameters and optimizer state stay as they were;
the step count and the RNG advance, and `state.scaler["skipped"]` counts it (checkpointed).
`raise`: fz.NonFiniteError on every rank naming the step, the first offending parameter
and the ranks whose loss was non-finite; the state given to the step is left unchanged.
fp16: an overflow is the loss scaler's business under both policies (skip the step and
lower the scale, as DeepSpeed); `raise` raises when lowering cannot help: a non-finite loss,
a static `loss_scale`, or a scale already at `min_loss_scale`.
Never silence: the `Spec.skip_limit`-th skipped step in a row (fp16's overflows included) is
fz.NonFiniteError under either policy, naming the first non-finite gradient; the count
(`state.scaler["skipped_in_a_row"]`) is in the state, so it survives a restore and is the same
on every rank.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import Shard

from fz.errors import NonFiniteError
from fz.step.scaler import skipped_in_a_row

Params = dict[str, Tensor]


def first_nonfinite(grads: Params) -> Tensor:
    """index + 1 of the first gradient holding a NaN or inf, else 0 (a 0-d tensor: no host sync)."""
    if not grads:
        return torch.zeros((), dtype=torch.int64)
    # a NaN or inf makes the sum non-finite: one read per gradient and no mask (an isfinite mask
    # cost ~15% of a small model's CPU step); fp32 sums overflow only near 1e38, itself a failure
    bad = torch.logical_not(torch.isfinite(torch.stack([g.sum(dtype=torch.float32) for g in grads.values()])))
    return torch.where(bad.any(), bad.to(torch.int64).argmax() + 1, 0)


def verdict_is_local(plan) -> bool:
    """Whether this rank's own reduced gradients decide: every rank holds the same, whole ones
    (the optimizer runs replicated: stage 0, or one rank per shard group)."""
    return plan.shards == 1 or all(not isinstance(b.place.opt, Shard) for b in plan.buckets if b.trainable)


def _describe(names: list[str], ranks: list[int], bad_grads: list[int], bad_losses: list[int]) -> str:
    parts = []
    owners = [(r, k) for r, k in zip(ranks, bad_grads) if k]
    if owners:
        r, k = min(owners, key=lambda rk: (rk[1], rk[0]))
        parts.append(f"the first non-finite gradient is {names[k - 1]!r} (seen on rank {r}"
                     + (f"; {len(owners)} ranks hold non-finite gradient shards" if len(owners) > 1 else "") + ")")
    lossy = [r for r, b in zip(ranks, bad_losses) if b]
    if lossy:
        parts.append(f"the loss is non-finite on rank(s) {lossy} (a NaN or inf in their batch or forward?)")
    return "; ".join(parts) or "a non-finite value"


class NonFinite:
    """One step's check: the local finding, then the verdict (skip or go on), or the error."""

    def __init__(self, spec, plan, step: int, scaler: dict[str, Tensor]):
        self.spec, self.plan, self.step, self.scaler = spec, plan, step, scaler
        self.names: list[str] = []
        self.first: Tensor | None = None

    def check(self, grads: Params, norms=None) -> Tensor:
        """This rank's finding on the gradients it holds, for the agreement's slot; from their
        norms when the step took them for clipping (fz/step/update.py: GradNorms), else one sum
        per gradient."""
        self.names = list(grads)
        self.first = norms.first_nonfinite() if norms is not None else first_nonfinite(grads)
        return self.first

    def skip(self, agreement, comm) -> bool:
        """True (on every rank alike) when the update must not run; NonFiniteError under "raise".
        Unless the verdict is local, `agreement` must be finished first."""
        if agreement.result is None:  # a local verdict: every rank holds the same reduced gradients
            assert self.first is not None, "check() comes first"
            if int(self.first) == 0:
                return False
            agreement.finish(comm)  # the rare bad step waits, for every rank's losses in the message
        if not any(agreement.bad_grads):
            return False
        spec = self.spec
        what = _describe(self.names, list(agreement.ranks), agreement.bad_grads, agreement.bad_losses)
        scaler_can_help = (spec.precision == "fp16" and not any(agreement.bad_losses)
                           and spec.loss_scaling.loss_scale == 0
                           and float(self.scaler["scale"]) > spec.loss_scaling.min_loss_scale)
        ls = spec.loss_scaling
        if spec.precision == "fp16" and ls.raise_at_min and ls.loss_scale == 0 and not scaler_can_help \
                and not any(agreement.bad_losses) and 1 in (ls.hysteresis, int(self.scaler["hysteresis"])):
            raise NonFiniteError(
                f"fz.train_step at step {self.step}: {what}, with the fp16 loss scale at min_loss_scale "
                f"({ls.min_loss_scale:g}) and no hysteresis left. DeepSpeed's ZeRO loss scaler stops here (\"Current "
                "loss scale already at minimum - cannot decrease scale anymore. Exiting run.\"), and so does fz "
                "(LossScale.raise_at_min, set by a DeepSpeed config at ZeRO 1-3). The state given to this step is "
                "unchanged.")
        if spec.nonfinite == "skip" or scaler_can_help:  # the latter: the loss scaler lowers the scale (DeepSpeed)
            self._within_limit(what)
            return True
        hint = ""
        if spec.precision == "fp16" and not any(agreement.bad_losses):
            hint = (" In fp16 the loss scale cannot go lower (a static loss_scale, or min_loss_scale reached), so "
                    "this overflow is not the loss scaler's to absorb.")
        raise NonFiniteError(
            f"fz.train_step at step {self.step}: {what}. Spec(nonfinite='raise') stops here on every rank; the "
            f"state given to this step is unchanged.{hint} Check that batch and the model's numerics, or use "
            "Spec(nonfinite='skip') to skip such steps (counted in state.scaler['skipped']).")

    def _within_limit(self, what: str) -> None:
        """NonFiniteError when this skip would be the Spec.skip_limit-th in a row."""
        limit, run = self.spec.skip_limit, skipped_in_a_row(self.scaler) + 1
        if limit is None or run < limit:
            return
        scale = (f" The fp16 loss scale is {float(self.scaler['scale']):g} (min_loss_scale "
                 f"{self.spec.loss_scaling.min_loss_scale:g})." if "scale" in self.scaler else "")
        raise NonFiniteError(
            f"fz.train_step at step {self.step}: {run} steps in a row were skipped (steps {self.step - run + 1} to "
            f"{self.step}, Spec.skip_limit={limit}), so the weights stopped changing. At this step {what}.{scale} "
            "Common causes: NaN or "
            "inf weights (fz.load_weights names them), a loss that is not finite for any batch, a diverged learning "
            "rate. The state given to this step is unchanged (skipped_in_a_row "
            f"{run - 1}); Spec(skip_limit=None) never stops.")
