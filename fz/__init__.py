"""fz: DeepSpeed's ZeRO as pure functional training on DTensor.

    state = fz.init(model, fz.Spec(stage=3, optimizer=fz.optim.adamw(lr=1e-3)))
    state, loss = fz.train_step(state, batch)
"""
from fz import optim
from fz.ckpt import Checkpointer, load_weights, restore, save, wait_for_checkpoints
from fz.comm_report import CommReport, comm_report
from fz.errors import ConfigError
from fz.init import init
from fz.memory import MemoryReport, memory_report
from fz.monitor import Monitor
from fz.params import full_params
from fz.spec import LossScale, Spec
from fz.state import State
from fz.step import apply, eval_step, train_step

__all__ = [
    "Checkpointer", "CommReport", "ConfigError", "LossScale", "MemoryReport", "Monitor", "Spec", "State",
    "apply", "comm_report", "eval_step", "full_params", "init", "load_weights", "memory_report",
    "optim", "restore", "save", "train_step", "wait_for_checkpoints",
]
__version__ = "0.1.0"
