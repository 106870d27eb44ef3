"""transformers' `lr_scheduler_type="reduce_lr_on_plateau"` on fz.hf.Trainer.

transformers builds torch's `ReduceLROnPlateau` over its optimizer (`lr_scheduler_kwargs` its
arguments), never steps it after an update, and steps it in `_evaluate` with the evaluation's
`metric_for_best_model` ("loss" unless set); the updates after that use the lr it left. fz's
lr is a function of the update count read at each update: `Plateau` answers with the lr its own
`ReduceLROnPlateau` (over a stand-in optimizer) holds now, and `trainer.lr_scheduler` is a view
that transformers' `_evaluate` steps as its own (fz/hf/views.py). Its state rides in the State's
data, so a checkpoint resumes with the lr, best metric and patience it had.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from fz.errors import CheckpointError
from fz.optim.base import LR_MAX
from fz.state import MAX_STEPS

KIND = "reduce_lr_on_plateau"
KWARGS = {"mode", "factor", "patience", "threshold", "threshold_mode", "cooldown", "min_lr", "eps"}
KEY = "lr_plateau"  # its state in the State's data


class Plateau:
    """The lr schedule of reduce_lr_on_plateau: torch's ReduceLROnPlateau's current lr at any count."""

    def __init__(self, lr: float, kwargs: dict[str, Any]):
        self.kwargs = dict(kwargs)
        self.opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
        self.plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(self.opt, **kwargs)

    def __call__(self, count: int) -> float:
        return float(self.opt.param_groups[0]["lr"])

    def step(self, metric: float) -> None:
        self.plateau.step(metric)

    def state_dict(self) -> dict[str, Any]:
        best = float(self.plateau.best)
        return {"lr": self(0), "best": best if math.isfinite(best) else None,
                "last_epoch": int(self.plateau.last_epoch), "num_bad_epochs": int(self.plateau.num_bad_epochs),
                "cooldown_counter": int(self.plateau.cooldown_counter)}

    def load_state_dict(self, saved: Any) -> None:
        """`saved` as state_dict gives it, checked first (it comes from a file)."""
        counts = ("last_epoch", "num_bad_epochs", "cooldown_counter")
        ok = isinstance(saved, dict) and set(saved) == {"lr", "best", *counts} \
            and all(type(saved[k]) is int and 0 <= saved[k] <= MAX_STEPS for k in counts) \
            and isinstance(saved["lr"], float) and 0 <= saved["lr"] <= LR_MAX \
            and (saved["best"] is None or isinstance(saved["best"], float) and math.isfinite(saved["best"]))
        if not ok:
            raise CheckpointError(f"the saved {KIND} state {str(saved)[:200]!r} is not one fz writes: damaged or "
                                  "altered")
        self.opt.param_groups[0]["lr"] = saved["lr"]
        self.plateau._last_lr = [saved["lr"]]
        self.plateau.best = saved["best"] if saved["best"] is not None else self.plateau.mode_worse
        for k in counts:
            setattr(self.plateau, k, saved[k])

    def __repr__(self) -> str:
        extra = ", ".join(f"{k}={v!r}" for k, v in sorted(self.kwargs.items()))
        return f"TrainingArguments.lr_scheduler_type={KIND!r} ({extra or 'torch defaults'}), now lr={self(0):g}"
