"""The step: forward/backward, gradient reduction, update, loss scaling."""
from fz.step.train import apply, eval_step, evaluate, train_step

__all__ = ["apply", "eval_step", "evaluate", "train_step"]
