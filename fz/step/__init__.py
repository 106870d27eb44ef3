"""The step: forward/backward, gradient reduction, update, loss scaling. `StepInProgress` is
train_step's phases, for a caller that runs each micro-batch's forward and backward itself."""
from fz.step.phases import StepInProgress
from fz.step.train import apply, eval_step, evaluate, train_step

__all__ = ["StepInProgress", "apply", "eval_step", "evaluate", "train_step"]
