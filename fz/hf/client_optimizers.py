"""A user's own optimizer and scheduler on fz.hf.Trainer, `Trainer(optimizers=(opt, sched))` and
`optimizer_cls_and_kwargs=`, used as transformers' Trainer uses them (fz/optim/from_torch.py
reads the torch objects into fz.optim's update and schedule).

transformers' Trainer steps the user's optimizer and scheduler; given only the optimizer, or
`optimizer_cls_and_kwargs`, it builds the rest as ever: `create_optimizer` (the decay groups,
the class and keywords given) and `create_scheduler` (lr_scheduler_type over the optimizer's
own lr). Under a DeepSpeed config its deepspeed_init drops `optimizers=`: the optimizer is the
config's or create_optimizer's, the scheduler the config's or create_scheduler's, and it says
nothing. fz does the same, and says so.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch

from fz.config.deepspeed import load as load_deepspeed
from fz.errors import ConfigError
from fz.optim.from_torch import client_optimizer, client_schedule

log = logging.getLogger(__name__)
CALL = "fz.hf.Trainer(optimizers=...)"
WHERE = (CALL, "choose it with TrainingArguments.optim")


@dataclass(frozen=True)
class GivenSchedule:
    """A torch scheduler's lrs as Spec's `schedule=` (a function of the optimizer's lr, which the
    scheduler carries itself)."""

    lrs: Any

    def __call__(self, lr: Any) -> Any:
        return self.lrs

    def __repr__(self) -> str:
        return repr(self.lrs)


def given_optimizer(trainer: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """`optimizers=` as given (checked when the Trainer is made: a class or groups fz cannot honour
    is named then); (None, None) where the DeepSpeed config drops them, with a warning."""
    opt, sched = kwargs.get("optimizers", (None, None))
    args = trainer.args
    if args.deepspeed and (opt is not None or sched is not None):
        log.warning("fz.hf.Trainer: optimizers=(...) is not used under a DeepSpeed config: transformers' "
                    "Trainer (deepspeed_init) trains with the config's optimizer and scheduler, or those the "
                    "arguments make (optim, lr_scheduler_type, optimizer_cls_and_kwargs); fz does the same")
        return None, None
    if sched is not None and opt is None:
        raise ConfigError(f"{CALL}: a scheduler without its optimizer steps the lr of an optimizer that does not "
                          "train (transformers' Trainer builds its own); pass optimizers=(optimizer, scheduler)")
    if opt is not None:
        client_optimizer(opt, trainer.model, WHERE)
    return opt, sched


def torch_pair(trainer: Any, model: torch.nn.Module, max_steps: int, cfg: dict[str, Any]) -> tuple[Any, Any]:
    """(the torch optimizer, the torch scheduler) transformers' Trainer would step where the user
    chose the optimizer (None, None where fz builds them from the arguments or the DeepSpeed config)."""
    import transformers

    opt, sched = trainer.__dict__.get("_fz_given", (None, None))
    if opt is None and trainer.optimizer_cls_and_kwargs is not None:
        if cfg.get("optimizer"):
            log.warning("fz.hf.Trainer: optimizer_cls_and_kwargs is not used: the DeepSpeed config has an "
                        "optimizer section, which transformers' Trainer trains with too")
            return None, None
        maker = copy.copy(trainer)
        maker.optimizer, maker.model = None, model  # transformers before 5 takes no model= (it reads self.model)
        opt = transformers.Trainer.create_optimizer(maker)
    if opt is not None and sched is None and not cfg.get("scheduler"):
        maker = copy.copy(trainer)
        maker.lr_scheduler = None
        sched = transformers.Trainer.create_scheduler(maker, max_steps, optimizer=opt)
    return opt, sched


def chosen_optimizer(trainer: Any, model: torch.nn.Module, max_steps: int) -> tuple[Any, Any]:
    """(Spec's optimizer=, schedule=) of the torch optimizer and scheduler transformers' Trainer
    would step (None for each that fz builds from the arguments or the DeepSpeed config)."""
    args = trainer.args
    cfg = load_deepspeed(args.deepspeed)[0] if args.deepspeed else {}
    opt, sched = torch_pair(trainer, model, max_steps, cfg)
    optimizer = client_optimizer(opt, model, WHERE) if opt is not None else None
    schedule = GivenSchedule(client_schedule(sched, opt, CALL)) if sched is not None else None
    return optimizer, schedule
