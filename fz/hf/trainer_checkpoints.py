"""What fz.hf.Trainer writes into `checkpoint-N/` and reads back on resuming.

A checkpoint holds fz's checkpoint of the State (`fz/`: weights, optimizer, data position and
the generator), `trainer_state.json`, the config, the tokenizer and `training_args.bin`, as
transformers' does; with `save_only_model=True` the model's weights (a `from_pretrained`
folder) in place of `fz/`, from which transformers cannot resume either. Written as
`tmp-checkpoint-N/` and renamed when complete (fz/hf/checkpoint_dirs.py). A PEFT model's adapter
is written beside `fz/` too, as the Trainer writes it (`PeftModel.from_pretrained(base, checkpoint)`).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from transformers.trainer_callback import ExportableState, TrainerState

import fz
from fz.ckpt.regular import inside, parse_json, read_regular
from fz.errors import CheckpointError, ConfigError
from fz.hf import checkpoint_dirs as dirs
from fz.hf.export import save_pretrained
from fz.hf.peft_export import is_peft_model
from fz.rng import capture

ARGS_FILE = "training_args.bin"  # transformers' TRAINING_ARGS_NAME


def tokenizer(trainer: Any) -> Any:
    """The tokenizer transformers saves beside the weights: processing_class, else the data
    collator's own (a collator made with one, as DataCollatorForLanguageModeling(tok))."""
    if trainer.processing_class is not None:
        return trainer.processing_class
    return getattr(trainer.data_collator, "tokenizer", None)


def save_checkpoint(trainer: Any, trial: Any) -> None:
    """Every rank (fz.save and the weights' gather are collectives); files on the rank that saves."""
    args = trainer.args
    run_dir = trainer._get_output_dir(trial=trial)
    step = trainer.state.global_step
    writes = args.should_save
    if writes:
        dirs.clear_staging(run_dir, step)  # a crashed save's leftovers; the others wait in fz.save's check-in
    staging = dirs.staging_dir(run_dir, step)
    tok = tokenizer(trainer)
    if args.save_only_model or is_peft_model(trainer.model):  # the weights; a PEFT adapter beside fz's too
        save_pretrained(trainer.fz_ready(), staging, model=trainer._model(), processing_class=tok)
    if not args.save_only_model:
        loader = trainer._loader
        state = loader.attach(trainer.fz_state) if loader is not None else trainer.fz_ready()
        state = state.replace(rng=capture(state.plan.device))  # the generator now, as transformers' rng_state
        fz.save(state, os.path.join(staging, dirs.FZ_DIR), verbose=False)
    best = trainer.state.best_global_step
    if best and (best == step or dirs.complete(dirs.final_dir(run_dir, best))):
        trainer.state.best_model_checkpoint = dirs.final_dir(run_dir, best)
    if not writes:
        return
    callbacks: Any = trainer.state.stateful_callbacks  # {class name: state, or a list of them}
    for cb in [*trainer.callback_handler.callbacks, trainer.control]:
        if isinstance(cb, ExportableState):
            name = cb.__class__.__name__
            saved = callbacks.get(name)
            if isinstance(saved, list):
                saved.append(cb.state())
            else:
                callbacks[name] = cb.state()
    os.makedirs(staging, exist_ok=True)
    config = getattr(trainer.model, "config", None)
    if config is not None and hasattr(config, "save_pretrained") and not args.save_only_model:
        config.save_pretrained(staging)
    if tok is not None and hasattr(tok, "save_pretrained") and not args.save_only_model:
        tok.save_pretrained(staging)
    torch.save(args, os.path.join(staging, ARGS_FILE))
    trainer.state.save_to_json(os.path.join(staging, dirs.STATE_FILE))
    dirs.publish(run_dir, step)
    dirs.rotate(run_dir, args.save_total_limit, keep=trainer.state.best_model_checkpoint)


def trainer_state(checkpoint: str) -> TrainerState:
    """`checkpoint/trainer_state.json` as transformers' TrainerState.load_from_json reads it, but as a
    bounded regular file inside the folder, an object of TrainerState's own fields."""
    folder = Path(checkpoint)
    path = folder / dirs.STATE_FILE
    try:
        raw = read_regular(inside(folder, path, "the trainer state"), "the trainer state")
        value = parse_json(raw, f"the trainer state {path}")
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {checkpoint} is not a complete checkpoint") from None
    except ValueError as e:  # JSON's own errors (CheckpointError is a ConfigError, not a ValueError)
        raise CheckpointError(f"the trainer state {path} is not JSON ({e}): damaged") from None
    fields = {f.name for f in dataclasses.fields(TrainerState)}
    if not isinstance(value, dict):
        raise CheckpointError(f"the trainer state {path} is not a JSON object: not what transformers writes")
    unknown = sorted(set(value) - fields)
    if unknown:
        raise CheckpointError(f"the trainer state {path} has keys TrainerState has not: {unknown[:5]}: not what "
                              "transformers writes")
    try:
        return TrainerState(**value)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"the trainer state {path} does not make a TrainerState ({e})") from None


def resume(trainer: Any, state: fz.State, checkpoint: str) -> fz.State:
    """`state` restored from `checkpoint`'s fz checkpoint, the trainer state and callbacks with it;
    with ignore_data_skip, the data from the start of the checkpoint's epoch, as transformers."""
    if not os.path.isdir(os.path.join(checkpoint, dirs.FZ_DIR)):
        raise ConfigError(f"fz.hf.Trainer: {checkpoint} was saved with save_only_model=True: it holds the model's "
                          "weights, not the optimizer or the data position, so training cannot resume from it "
                          "(nor in transformers). Load the weights with from_pretrained and start a new run")
    saved = trainer_state(checkpoint)  # read and checked before the State is given to the restore
    restored = fz.restore(state, os.path.join(checkpoint, dirs.FZ_DIR), verbose=False)
    assert isinstance(restored, fz.State)
    trainer.state = saved
    trainer._load_callback_state()
    trainer.state.global_step = int(restored.step)
    position = restored.data.get("loader") if isinstance(restored.data, dict) else None
    if trainer.args.ignore_data_skip and isinstance(position, dict):  # transformers' epochs_trained, from its start
        per_epoch = trainer._max_steps()[1]
        epoch = trainer.state.global_step // per_epoch if per_epoch else int(position["epoch"])
        restored = restored.replace(data={**restored.data, "loader": {**position, "epoch": epoch, "index": 0}})
    return restored
