"""Trainers whose own `training_step` makes each micro-batch's inputs, then hands them on (TRL's
GKD: with probability `lmbda` the student generates the completions it trains on, with
`seq_kd` the teacher, refused here): on fz their `training_step` runs as written, once per micro-batch,
with `trainer.model` holding the State's current weights, and what it hands on to
`super().training_step` (fz.hf.Trainer's, below it in the class order) is recorded and trained
by fz.train_step (their `compute_loss`). transformers' loop draws and generates micro-batch by
micro-batch, between the forwards: the same draws, in the same order, unless the forward draws
too (dropout), which then comes after all of the step's generation.
"""
from __future__ import annotations

from typing import Any

import torch

import fz
from fz.errors import ConfigError
from fz.hf import draws
from fz.hf.online import pull

# TRL's trainers whose training_step only prepares each micro-batch's inputs, then calls super()
PREPARING = ("GKDTrainer",)


def refused(trainer: Any) -> list[str]:
    """What such a trainer's step would do that fz does not run, worded."""
    if preparing_class(trainer) is None or not getattr(trainer.args, "seq_kd", False):
        return []
    return ["seq_kd=True: the teacher generates the completions, and fz's teacher is an inference-only State whose "
            "generate draws from its own generator, not the process's (TRL's draws); use seq_kd=False"]


def preparing_class(trainer: Any) -> type | None:
    """TRL's trainer class `trainer` is (or derives from) whose training_step prepares inputs, else None."""
    for klass in type(trainer).__mro__:
        if klass.__name__ in PREPARING and klass.__module__.startswith("trl.") and "training_step" in vars(klass):
            return klass
    return None


class RecordedStep:
    """transformers.Trainer.training_step under fz: what a subclass's training_step hands on is
    recorded (`prepare`), its forward and backward fz.train_step's. Called otherwise, an error."""

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        record = self.__dict__.get("_fz_step_inputs")
        if record is None:
            raise ConfigError("fz.hf.Trainer.training_step: fz.train_step runs each update; fz's loop calls "
                              "training_step only to read the inputs a subclass's own step makes (TRL's GKD)")
        record.append(inputs)
        return torch.zeros(())


def preparing_step(trainer: Any) -> Any:
    """`train_step` for a trainer whose training_step makes its inputs, else None."""
    return train_step if preparing_class(trainer) is not None else None


def train_step(trainer: Any, batches: fz.MicroBatches) -> fz.State:
    """One update: each micro-batch's inputs made by the trainer's training_step, then trained."""
    return draws.train_step(trainer.fz_state, prepare(trainer, batches))[0]


def prepare(trainer: Any, batches: fz.MicroBatches) -> fz.MicroBatches:
    """Each micro-batch as the trainer's training_step makes it, the weights held (every rank)."""
    held = float(getattr(trainer, "lmbda", 1.0)) > 0  # GKD's student generates only below lmbda
    if held:
        pull(trainer)
    got: list[Any] = []
    trainer.__dict__["_fz_step_inputs"] = got
    try:
        for batch in batches:
            trainer.training_step(trainer.model, batch, trainer._items)
    finally:
        del trainer.__dict__["_fz_step_inputs"]
        if held:
            trainer._let_go_of_weights()
    if len(got) != len(batches):
        raise ConfigError(f"fz.hf: {type(trainer).__name__}.training_step handed on {len(got)} inputs for "
                          f"{len(batches)} micro-batches; fz trains what it hands to super().training_step once each")
    return fz.MicroBatches(got)
