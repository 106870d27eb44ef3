"""Resuming fz.hf.Trainer from a `checkpoint-N/` that transformers + DeepSpeed wrote.

A run moved from DeepSpeed to fz goes on where it stopped, as transformers + DeepSpeed's own
resume would: the weights, Adam's moments, the step and the loss scale from DeepSpeed's tag
folder (`fz.import_deepspeed`: any stage and world size into this run's), the trainer state
from `trainer_state.json` (read as fz's own), the data position as transformers derives it from
`global_step` (the epochs trained, then the steps into the next), and this rank's generators
from `rng_state_{rank}.pth` (`rng_state.pth` on one process) read as transformers reads it:
`torch.load(weights_only=True)` with numpy's few types allowed, never run, after the file is
checked to be a small regular file inside the folder. fz's learning rate is a function of the
step, so DeepSpeed's scheduler state (or transformers' `scheduler.pt`) has nothing to add.
"""
from __future__ import annotations

import io
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import fz
from fz.ckpt.regular import inside, read_regular
from fz.errors import CheckpointError
from fz.hf import host_generators
from fz.rng import problem, well_formed

log = logging.getLogger(__name__)
RNG_MAX = 1 << 20  # transformers' rng_state file: the generators' states, a few KiB


def rng_file(checkpoint: str, args: Any) -> Path:
    """The file transformers' `_load_rng_state` reads for this rank."""
    name = f"rng_state_{args.process_index}.pth" if args.world_size > 1 else "rng_state.pth"
    return Path(checkpoint) / name


def read_generators(checkpoint: str, args: Any,
                    device: torch.device) -> tuple[torch.Tensor, Callable[[], None] | None] | None:
    """(the torch generators' state as fz.rng keeps it, a function setting python's and numpy's),
    from this rank's rng_state file; None (logged, as transformers does) when there is none."""
    path = rng_file(checkpoint, args)
    if not path.exists():
        log.info("fz.hf.Trainer: %s has no %s: the resumed run's random draws are not the interrupted run's",
                 checkpoint, path.name)
        return None
    from transformers.trainer_pt_utils import safe_globals  # numpy's array and dtype, as transformers allows

    raw = read_regular(inside(Path(checkpoint), path, "the generators' state"), "the generators' state", RNG_MAX)
    try:
        with safe_globals():
            saved = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as e:  # noqa: BLE001 - an unpickling error of any kind: refused, worded
        raise CheckpointError(f"the generators' state {path} is not what transformers writes ({type(e).__name__}: "
                              f"{str(e)[:200]}): damaged") from None
    cpu = saved.get("cpu") if isinstance(saved, dict) else None
    if not isinstance(cpu, torch.Tensor) or not well_formed(cpu.dtype, tuple(cpu.shape)):
        raise CheckpointError(f"the generators' state {path} holds no CPU generator state transformers writes: "
                              "damaged")
    why = problem(cpu)
    if why is not None:
        raise CheckpointError(f"the generators' state {path}: the CPU generator's {why}: damaged")
    state = cpu
    cuda = saved.get("cuda")
    if device.type == "cuda" and isinstance(cuda, (list, tuple)):  # saved by one process: every device's
        cuda = cuda[device.index or 0] if len(cuda) > (device.index or 0) else None
    if device.type == "cuda" and isinstance(cuda, torch.Tensor) and cuda.dtype == torch.uint8 and cuda.dim() == 1 \
            and cuda.numel() <= 256:
        state = torch.cat([cpu, cuda])
    try:  # python's and numpy's, checked as fz's own checkpoints' are (numpy takes a position past its words)
        as_json = host_generators.as_json(saved["python"], saved["numpy"])
    except (KeyError, TypeError, IndexError, ValueError, OverflowError) as e:
        raise CheckpointError(f"the generators' state {path} holds no python and numpy states transformers writes "
                              f"({type(e).__name__}): damaged") from None
    host = host_generators.setter(as_json, f"the generators' state {path}")
    return state, host


def position(reader: fz.data.Loader, state: fz.State, global_step: int) -> fz.State:
    """`state` with the training data's position where transformers resumes after `global_step`
    steps: its epoch (steps // steps per epoch), then the steps into it."""
    per_epoch = reader.steps_per_epoch
    epoch, into = divmod(global_step, per_epoch) if per_epoch else (0, global_step)
    reader.seek(epoch, into * reader.layout.global_rows)
    return reader.attach(state)


def resume(trainer: Any, state: fz.State, checkpoint: str, global_step: int) -> tuple[fz.State, Any]:
    """(`state` from DeepSpeed's checkpoint in `checkpoint` and the data position after
    `global_step`, the generators' saved state or None). Every rank calls it."""
    reader = trainer._train_loader().loader  # this run's data layout and order, made before `state` is given up
    restored, _ = fz.import_deepspeed(state, checkpoint)  # a PEFT run's: the adapter only, the base is the model's
    if int(restored.step) != global_step:
        raise CheckpointError(f"{checkpoint}: DeepSpeed's checkpoint is at step {int(restored.step)}, its "
                              f"trainer_state.json at {global_step}: not one save")
    log.info("fz.hf.Trainer: resuming from %s, written by transformers + DeepSpeed, at step %d", checkpoint,
             global_step)
    generators = read_generators(checkpoint, trainer.args, restored.plan.device)
    return position(reader, restored, global_step), generators
