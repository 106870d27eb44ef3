"""fz.hf.Trainer's evaluation: transformers' evaluation loop, each batch's forward on the State.

transformers' `evaluate` / `predict` loops over the evaluation set and gathers what each batch
gives; fz.hf.Trainer hands it `Evaluated` as the model (so Accelerate does not prepare, wrap or
move the user's model) and runs each batch with `fz.apply` on the State (stage 3 gathers block
by block; every rank takes part). The loss is the model's own, as transformers' prediction_step
takes it when it counts no items.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

import fz


class Evaluated(nn.Module):
    """What `_wrap_model` returns: calling it runs fz.apply on the trainer's State."""

    trainer: Any

    def __init__(self, trainer: Any):
        super().__init__()
        object.__setattr__(self, "trainer", trainer)  # not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return fz.apply(self.trainer.fz_ready(), *args, **kwargs)


def prediction(trainer: Any, inputs: dict[str, Any], prediction_loss_only: bool,
               ignore_keys: list[str] | None) -> tuple[Any, Any, Any]:
    """transformers' prediction_step on fz: (loss, logits, labels) of one prepared batch."""
    has_labels = bool(trainer.label_names) and all(inputs.get(k) is not None for k in trainer.label_names)
    if ignore_keys is None:
        ignore_keys = list(getattr(getattr(trainer.model, "config", None), "keys_to_ignore_at_inference", []) or [])
    with torch.no_grad():
        out = fz.apply(trainer.fz_ready(), **inputs)
    loss = None
    if has_labels:
        loss = (out["loss"] if isinstance(out, dict) else out[0]).detach().mean()
    if prediction_loss_only:
        return loss, None, None
    if isinstance(out, dict):
        logits = tuple(v for k, v in out.items() if k not in [*ignore_keys, "loss"])
    else:
        logits = tuple(out[1:] if has_labels else out)
    labels = tuple(inputs.get(k) for k in trainer.label_names) if has_labels else None
    return (loss, logits[0] if len(logits) == 1 else logits,
            labels[0] if labels is not None and len(labels) == 1 else labels)
