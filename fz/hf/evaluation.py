"""fz.hf.Trainer's evaluation: transformers' evaluation loop, each batch's forward on the State.

transformers' `evaluate` / `predict` loops over the evaluation set and gathers what each batch
gives; fz.hf.Trainer hands it `Evaluated` as the model (so Accelerate does not prepare, wrap or
move the user's model) and runs each batch with `fz.apply` on the State (stage 3 gathers block
by block; every rank takes part). The loss is what transformers' prediction_step takes:
`compute_loss` (a subclass's override, TRL's, `compute_loss_func`) with the batch's
`num_items_in_batch`, summed over ranks by fz (bounded) rather than by accelerate's gather.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from transformers.trainer_pt_utils import nested_detach

import fz
from fz.hf import counts
from fz.hf.redirection import RunsRedirected


def prepared(trainer: Any, call: str) -> fz.State:
    """The State (made, the model sharded, where it was not). transformers' first evaluation or
    prediction before any training prepares the model there and reports the time it took as
    `model_preparation_time`, in it and in every later one: so does this, for `call`."""
    if call not in ("evaluate", "predict") or trainer._loader is not None or \
            hasattr(trainer, "model_preparation_time"):  # trained: prepared by train()
        return trainer.fz_ready()
    start = time.time()
    state = trainer.fz_ready()
    trainer.model_preparation_time = round(time.time() - start, 4)
    return state


class Evaluated(RunsRedirected):
    """What `_wrap_model` returns: calling it runs fz.apply on the trainer's State.

    `train(mode)` / `eval()` reach the user's model, as transformers' evaluation loop puts
    it in eval mode (TRL reads `trainer.model.training` to tell evaluation from training);
    an attribute it lacks (`config`, `name_or_path`, ...) is the user's model's, or, while a
    forward put in its place runs (TRL's forward redirection: fz/hf/redirection.py), fz's copy's."""

    trainer: Any

    def __init__(self, trainer: Any):
        super().__init__()
        object.__setattr__(self, "trainer", trainer)  # not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return fz.apply(self.trainer.fz_ready(), *args, **kwargs)

    def train(self, mode: bool = True) -> Evaluated:
        super().train(mode)
        model = self.trainer.model
        if isinstance(model, nn.Module):
            model.train(mode)
        return self

    def _redirect_state(self) -> fz.State:
        return self.trainer.fz_ready()

    def _get_name(self) -> str:
        """The name transformers' compute_loss reads of the unwrapped model (label smoothing shifts
        a causal LM's labels): the user's model's, or its base model's under PEFT."""
        model = self.trainer.model
        return (model.base_model.model if _is_peft(model) else model)._get_name()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inside = self._inside()
            if inside is not None:
                return getattr(inside, name)
            value = getattr(object.__getattribute__(self, "trainer").model, name)
            if isinstance(value, (nn.Module, torch.Tensor)):  # the user's copy is not the State's weights
                raise AttributeError(f"{name!r} of the user's model is not the trained one: fz.hf.Trainer "
                                     "evaluates on its State (trainer.fz_state); read weights with "
                                     "fz.full_params or after train()") from None
            return value


def _is_peft(model: Any) -> bool:
    try:
        from peft import PeftMixedModel, PeftModel
    except ImportError:
        return False
    return isinstance(model, (PeftModel, PeftMixedModel))


def prediction(trainer: Any, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
               ignore_keys: list[str] | None) -> tuple[Any, Any, Any]:
    """transformers' prediction_step on fz: (loss, logits, labels) of one batch."""
    names = list(trainer.label_names)
    has_labels = bool(names) and all(inputs.get(k) is not None for k in names)
    return_loss = inputs.get("return_loss")
    if return_loss is None:
        return_loss = trainer.can_return_loss
    with_loss = has_labels or (not names and bool(return_loss))  # CLIP-like models, TRL's RewardTrainer
    inputs = trainer._prepare_inputs(inputs)
    if ignore_keys is None:
        config = getattr(trainer.model, "config", None)
        ignore_keys = list(getattr(config, "keys_to_ignore_at_inference", ["cache"])) if config is not None else []
    labels: Any = None
    if with_loss:  # taken first: a loss may pop them (label smoothing)
        labels = nested_detach(tuple(inputs.get(k) for k in names))
        labels = labels[0] if len(labels) == 1 else labels
    loss = None
    with torch.no_grad(), trainer.compute_loss_context_manager():
        if with_loss:
            items = counts.num_items(trainer, [inputs])
            loss, outputs = trainer.compute_loss(model, inputs, return_outputs=True, num_items_in_batch=items)
            loss = loss.detach().mean()
            drop = [*ignore_keys, "loss"]
            logits = tuple(v for k, v in outputs.items() if k not in drop) if isinstance(outputs, dict) else outputs[1:]
        else:
            outputs = model(**inputs)
            logits = tuple(v for k, v in outputs.items() if k not in ignore_keys) if isinstance(outputs, dict) \
                else outputs
    if prediction_loss_only:
        return loss, None, None
    logits = nested_detach(logits)
    return loss, logits[0] if len(logits) == 1 else logits, labels
