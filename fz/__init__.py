"""fz: DeepSpeed's ZeRO as pure functional training on DTensor.

    state = fz.init(model, fz.Spec(stage=3, optimizer=fz.optim.adamw(lr=1e-3)))
    state, loss = fz.train_step(state, batch)
"""
from fz import data, distributed, offload, optim
from fz.ckpt import Checkpointer, CheckpointInfo, Consolidated, load_weights, restore, save, wait_for_checkpoints
from fz.ckpt.deepspeed.importer import import_deepspeed
from fz.errors import CheckpointError, ConfigError, NonFiniteError, OffloadError, PeerError
from fz.init_state import init
from fz.observe.comm_report import CommReport, comm_report
from fz.observe.full_params import full_params
from fz.observe.memory import MemoryReport, memory_report
from fz.observe.monitor import Monitor
from fz.planning import estimate, estimate_table, plan
from fz.spec import LossScale, Spec
from fz.state import State, block_until_ready
from fz.step.batches import MicroBatches
from fz.step.generate import generate
from fz.step.sums import sum_over_ranks
from fz.step.train import apply, eval_step, evaluate, train_step
from fz.version import __version__

__all__ = [
    "CheckpointError", "CheckpointInfo", "Checkpointer", "CommReport", "ConfigError", "Consolidated", "LossScale",
    "MemoryReport", "MicroBatches", "Monitor", "NonFiniteError", "OffloadError", "PeerError", "Spec", "State",
    "__version__",
    "apply", "block_until_ready", "comm_report", "data", "distributed", "estimate", "estimate_table", "eval_step",
    "evaluate", "full_params", "generate", "import_deepspeed", "init", "load_weights", "memory_report", "offload",
    "optim", "plan", "restore", "save", "sum_over_ranks", "train_step", "wait_for_checkpoints",
]
