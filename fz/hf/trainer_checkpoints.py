"""What fz.hf.Trainer writes into `checkpoint-N/` and reads back on resuming.

A checkpoint holds fz's checkpoint of the State (`fz/`: weights, optimizer, data position and
the generator), `trainer_state.json`, the config, the tokenizer and `training_args.bin`, and the
weights where transformers' does (`weights_in_checkpoints`); with `save_only_model=True` the
weights (a `from_pretrained` folder) in place of `fz/`, from which transformers cannot resume
either. Written as `tmp-checkpoint-N/` and renamed when complete (fz/hf/checkpoint_dirs.py). A PEFT model's adapter
is written beside `fz/` too, as the Trainer writes it (`PeftModel.from_pretrained(base, checkpoint)`).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers.trainer_callback import ExportableState, TrainerState
from transformers.trainer_utils import compare_trainer_and_checkpoint_args

import fz
from fz.ckpt.regular import inside, parse_json, read_regular
from fz.config.deepspeed import load as load_deepspeed
from fz.config.keys import gathers_16bit_on_save
from fz.errors import CheckpointError, ConfigError
from fz.hf import checkpoint_dirs as dirs
from fz.hf import deepspeed_resume, host_generators, plateau
from fz.hf.export import save_generation_config, save_pretrained
from fz.hf.peft_export import is_peft_model
from fz.hf.plateau import Plateau
from fz.hf.views import schedule_of
from fz.rng import capture, restore
from fz.storage.fresh import open_fresh

log = logging.getLogger(__name__)

ARGS_FILE = "training_args.bin"  # transformers' TRAINING_ARGS_NAME


def save_args(args: Any, folder: str | os.PathLike[str]) -> None:
    """`training_args.bin` (transformers' pickle of the arguments) in `folder`, made anew: a link
    planted under its name is not written through."""
    with open_fresh(os.path.join(folder, ARGS_FILE)) as f:
        torch.save(args, f)


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
    weights = args.save_only_model or is_peft_model(trainer.model) or weights_in_checkpoints(trainer)
    if weights:  # the weights (with their config), as transformers' save_model writes them; a PEFT adapter
        save_pretrained(trainer.fz_ready(), staging, model=trainer._model(), processing_class=tok,
                        dtype=saved_dtype(trainer))
    if not args.save_only_model:
        loader = trainer._loader
        state = loader.attach(trainer.fz_state) if loader is not None else trainer.fz_ready()
        state = state.replace(rng=capture(state.plan.device))  # the generators now, as transformers' rng_state
        if isinstance(state.data, dict):
            state = state.replace(data={**state.data, host_generators.KEY: host_generators.captured()})
            if isinstance(schedule := schedule_of(state), Plateau):  # its lr, best metric and patience
                state = state.replace(data={**state.data, plateau.KEY: schedule.state_dict()})
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
    config: Any = getattr(trainer.model, "config", None)
    if hasattr(config, "save_pretrained") and not weights:  # written with the weights (a PEFT adapter: none, as PEFT)
        config.save_pretrained(staging)
        save_generation_config(trainer.model, staging)  # as transformers' checkpoint-N/ (fz consolidate --hf copies it)
    if tok is not None and hasattr(tok, "save_pretrained") and not args.save_only_model:
        tok.save_pretrained(staging)
    save_args(args, staging)
    trainer.state.save_to_json(os.path.join(staging, dirs.STATE_FILE))
    dirs.publish(run_dir, step)
    dirs.rotate(run_dir, args.save_total_limit, keep=trainer.state.best_model_checkpoint)


def saved_dtype(trainer: Any) -> torch.dtype | None:
    """The dtype transformers' save_model writes: a model loaded wholly in bf16 (fp16) in that dtype
    (its own parameters, which DeepSpeed's module keeps too); else under DeepSpeed the module's, the
    precision the run computes in (None); without, the model's own parameters, fp32 (the masters)
    under bf16 or fp16 autocast."""
    from fz.hf.model_weights import loaded_half
    half = loaded_half(trainer._model(), trainer._fz_released)
    if half is not None:
        return half
    return None if trainer.args.deepspeed else torch.float32


def module_dtype(trainer: Any) -> torch.dtype | None:
    """The dtype `trainer.model` holds after training: with a DeepSpeed bf16 (fp16) config that one,
    DeepSpeed's module being cast whole to it; otherwise its own (None)."""
    precision = trainer.fz_ready().spec.precision
    if not trainer.args.deepspeed or precision == "fp32":
        return None
    return torch.bfloat16 if precision == "bf16" else torch.float16


def weights_in_checkpoints(trainer: Any) -> bool:
    """Whether transformers' checkpoint-N holds the model's weights (its _save_checkpoint calls
    save_model): at ZeRO 0-2 (DeepSpeed's module is whole on each rank) and without DeepSpeed; at
    ZeRO-3 only with the config's 16-bit gather on save (else DeepSpeed's own files hold them)."""
    if trainer.fz_ready().spec.stage < 3:
        return True
    return bool(trainer.args.deepspeed) and gathers_16bit_on_save(load_deepspeed(trainer.args.deepspeed)[0])


def end_with_the_best(trainer: Any, trial: Any) -> fz.State | None:
    """transformers' end of train() about the best checkpoint: with load_best_model_at_end the State
    from it (`load_best`), then with save_total_limit=1 only it kept (`keep_the_best`)."""
    state = load_best(trainer)
    keep_the_best(trainer, trial)
    return state


def load_best(trainer: Any) -> fz.State | None:
    """The State, from the best checkpoint with load_best_model_at_end: its whole state, weights
    and optimizer, as transformers + DeepSpeed loads it (deepspeed_load_checkpoint); only the weights
    from a save_only_model checkpoint, as transformers loads them. Every rank calls it."""
    best, state = trainer.state.best_model_checkpoint, trainer.fz_state
    if not (trainer.args.load_best_model_at_end and best is not None and state is not None):
        return state
    resumed = trainer.__dict__.get("_fz_resumed_run")
    if resumed is None or not Path(best).resolve().is_relative_to(resumed):  # the run's, or the resumed run's
        inside(Path(trainer._get_output_dir(trial=None)), Path(best), "the best checkpoint", "the run folder")
    log.info("fz.hf.Trainer: loading the best model from %s (score: %s)", best, trainer.state.best_metric)
    if os.path.isdir(os.path.join(best, dirs.FZ_DIR)):
        loaded = fz.restore(state, os.path.join(best, dirs.FZ_DIR), verbose=False)
        assert isinstance(loaded, fz.State)
        return loaded
    weights = [os.path.join(best, n) for n in ("model.safetensors", "model.safetensors.index.json")]
    if not any(os.path.isfile(w) for w in weights):
        raise ConfigError(f"fz.hf.Trainer: load_best_model_at_end: {best} holds neither fz's checkpoint nor "
                          "model.safetensors (as transformers, which cannot load it either)")
    return fz.load_weights(state, best)


def keep_the_best(trainer: Any, trial: Any) -> None:
    """transformers' end of train(): with save_total_limit=1 only the best checkpoint stays
    (rotation kept the newest beside it while training)."""
    args, best = trainer.args, trainer.state.best_model_checkpoint
    if not (args.should_save and best is not None and args.save_total_limit == 1):
        return
    run = dirs.numbered(trainer._get_output_dir(trial=trial))
    if not any(path.resolve() == Path(best).resolve() for _, path in run):  # the best is a checkpoint of this run
        return
    for _, path in run:
        if path.resolve() != Path(best).resolve():
            log.info("fz.hf.Trainer: deleting %s (save_total_limit=1 keeps the best checkpoint)", path)
            shutil.rmtree(path, ignore_errors=True)


_NUM, _NONE = (int, float), type(None)
_FIELD_TYPES: dict[str, tuple[type, ...]] = {  # TrainerState's fields as its JSON holds them
    **dict.fromkeys(("epoch", "global_step", "max_steps", "logging_steps", "eval_steps", "save_steps",
                     "num_train_epochs", "num_input_tokens_seen", "total_flos"), _NUM),
    **dict.fromkeys(("train_batch_size", "best_metric", "best_global_step"), (*_NUM, _NONE)),
    **dict.fromkeys(("best_model_checkpoint", "trial_name"), (str, _NONE)),
    **dict.fromkeys(("is_local_process_zero", "is_world_process_zero", "is_hyper_param_search"), (bool,)),
    "log_history": (list,), "trial_params": (dict, _NONE), "stateful_callbacks": (dict, _NONE)}
_COUNTS = ("global_step", "max_steps", "num_input_tokens_seen", "best_global_step", "train_batch_size")
_INTERVALS = ("logging_steps", "eval_steps", "save_steps")  # the loop divides by them
_AMOUNTS = ("epoch", "num_train_epochs", "total_flos")


def _out_of_range(name: str, v: Any) -> str | None:
    """Why a number (or the best checkpoint's path) of the right type cannot be what transformers wrote."""
    if v is None or name == "best_metric":
        return None
    if name in _COUNTS and not (isinstance(v, int) and 0 <= v <= 2**62):
        return "not a whole number from 0 to 2**62"
    if name in _INTERVALS and not (math.isfinite(v) and v > 0):
        return "not a finite number > 0"
    if name in _AMOUNTS and not (math.isfinite(v) and v >= 0):
        return "not a finite number >= 0"
    if name == "best_model_checkpoint" and ("\0" in v or not dirs.is_checkpoint_name(os.path.basename(v))):
        return "not the path of a checkpoint-N folder"
    return None


def _wrong_field(value: dict[str, Any]) -> str | None:
    """The first field of a trainer state's JSON of a type TrainerState's is not (a bool is no
    number), or whose contents transformers would not have written, worded; None if all are."""
    for name, v in value.items():
        types = _FIELD_TYPES.get(name)
        if types is not None and (not isinstance(v, types) or (isinstance(v, bool) and bool not in types)):
            return f"{name} is {v!r:.60}, not {' or '.join('null' if t is _NONE else t.__name__ for t in types)}"
        why = _out_of_range(name, v) if types is not None else None
        if why is not None:
            return f"{name} is {v!r:.60}: {why}"
    if not all(isinstance(e, dict) for e in value.get("log_history") or []):
        return "log_history is not a list of objects"
    for name, saved in (value.get("stateful_callbacks") or {}).items():
        for s in saved if isinstance(saved, list) else [saved]:
            parts = [s.get("args", {}), s.get("attributes", {})] if isinstance(s, dict) else [None]
            if not all(isinstance(p, dict) and not any(k.startswith("__") for k in p) for p in parts):
                return (f"stateful_callbacks[{name!r:.60}] is {s!r:.80}, not an object of 'args' and 'attributes' "
                        "objects (of names without '__')")
    return None


def trainer_state(checkpoint: str) -> TrainerState:
    """`checkpoint/trainer_state.json` as transformers' TrainerState.load_from_json reads it, but as a
    bounded regular file inside the folder, an object of TrainerState's own fields of their types;
    the folder's `fz/` must not lead out of it either."""
    folder = Path(checkpoint)
    path = folder / dirs.STATE_FILE
    if (folder / dirs.FZ_DIR).exists():
        inside(folder, folder / dirs.FZ_DIR, "fz's checkpoint", "the checkpoint folder")
    try:
        raw = read_regular(inside(folder, path, "the trainer state"), "the trainer state")
        value = parse_json(raw, f"the trainer state {path}")
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {checkpoint} is not a complete checkpoint") from None
    except CheckpointError:  # a ConfigError, so a ValueError too: worded already
        raise
    except ValueError as e:  # JSON's own errors
        raise CheckpointError(f"the trainer state {path} is not JSON ({e}): damaged") from None
    fields = {f.name for f in dataclasses.fields(TrainerState)}
    if not isinstance(value, dict):
        raise CheckpointError(f"the trainer state {path} is not a JSON object: not what transformers writes")
    unknown = sorted(set(value) - fields)
    if unknown:
        raise CheckpointError(f"the trainer state {path} has keys TrainerState has not: {unknown[:5]}: not what "
                              "transformers writes")
    wrong = _wrong_field(value)
    if wrong is not None:
        raise CheckpointError(f"the trainer state {path}: {wrong}: damaged, or not what transformers writes")
    try:
        return TrainerState(**value)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"the trainer state {path} does not make a TrainerState ({e})") from None


def _best_beside(best: str | None, checkpoint: str) -> str | None:
    """The best checkpoint a resumed state records, read only beside `checkpoint` (in its run folder;
    a run moved elsewhere: its folder of that name there): one elsewhere would load another run's
    weights at the end. None when there is none (as transformers, which forgets a missing one)."""
    if best is None:
        return None
    run = Path(checkpoint).resolve().parent
    here = run / os.path.basename(os.path.normpath(best))
    if here.is_dir():
        return str(here)
    if Path(best).resolve().parent != run:
        log.warning("fz.hf.Trainer: the best checkpoint %s recorded in the resumed state is not in the run folder "
                    "%s: ignored for this run (load_best_model_at_end reads only the run's own)", best, run)
    else:  # as transformers
        log.warning("fz.hf.Trainer: the best checkpoint %s recorded in the resumed state does not exist anymore. "
                    "Ignoring it for this run.", best)
    return None


def resume(trainer: Any, state: fz.State, checkpoint: str) -> tuple[fz.State, Callable[[], None] | None]:
    """(`state` restored from `checkpoint` (fz's, or one transformers + DeepSpeed wrote), the trainer
    state and callbacks with it, a function setting the generators as saved); with ignore_data_skip
    the data from the start of the checkpoint's epoch, as transformers."""
    by_deepspeed = dirs.written_by_deepspeed(checkpoint) is not None
    if not by_deepspeed and not os.path.isdir(os.path.join(checkpoint, dirs.FZ_DIR)):
        torch_state = [f for f in ("optimizer.pt", "optimizer.bin", "scheduler.pt") if os.path.isfile(
            os.path.join(checkpoint, f))]
        if torch_state:
            raise ConfigError(f"fz.hf.Trainer: {checkpoint} was saved by transformers' Trainer without DeepSpeed (its "
                              f"{torch_state[0]} is a torch optimizer's state): fz resumes from its own checkpoints "
                              "and from transformers + DeepSpeed's. Load the weights with from_pretrained (or "
                              "fz.init(weights=)) and start a new run")
        raise ConfigError(f"fz.hf.Trainer: {checkpoint} was saved with save_only_model=True: it holds the model's "
                          "weights, not the optimizer or the data position, so training cannot resume from it "
                          "(nor in transformers). Load the weights with from_pretrained and start a new run")
    trainer.state = trainer_state(checkpoint)  # read, checked and applied before the State is given to restore
    saved_steps, steps = int(trainer.state.max_steps or 0), trainer._max_steps()[0]
    if saved_steps and saved_steps != steps:  # the schedule differs: never silently
        log.warning("fz.hf.Trainer: resuming a run of max_steps=%d with max_steps=%d: fz trains the next step with "
                    "this run's lr schedule; transformers' Trainer (and DeepSpeed) train it with the lr the saved "
                    "run's schedule left in its optimizer, then follow this run's", saved_steps, steps)
    named = dirs.number(os.path.basename(os.path.normpath(checkpoint)))  # a folder of another name: as given
    # a checkpoint-N's number orders the run's checkpoints (rotation, resume_from_checkpoint=True)
    if named is not None and named != trainer.state.global_step:
        raise CheckpointError(f"{checkpoint} holds the trainer state of step {trainer.state.global_step}, not "
                              f"{named}: renamed, or not this folder's (transformers names it checkpoint-<step>)")
    trainer.__dict__["_fz_resumed_run"] = str(Path(checkpoint).resolve().parent)  # where load_best may read too
    trainer.state.best_model_checkpoint = _best_beside(trainer.state.best_model_checkpoint, checkpoint)
    if trainer.state.train_batch_size is not None:  # transformers' comparison divides it (it always writes one)
        compare_trainer_and_checkpoint_args(trainer.args, trainer.state)  # its warning: the saved intervals are kept
    try:
        trainer._load_callback_state()
    except (TypeError, ValueError, AttributeError) as e:  # a callback's saved args it does not take
        raise CheckpointError(f"the trainer state {os.path.join(checkpoint, dirs.STATE_FILE)}: its stateful_callbacks "
                              f"do not make this run's callbacks ({type(e).__name__}: {e})") from None
    if by_deepspeed:
        restored, generators = deepspeed_resume.resume(trainer, state, checkpoint, trainer.state.global_step)
    else:
        loaded = fz.restore(state, os.path.join(checkpoint, dirs.FZ_DIR), verbose=False)
        assert isinstance(loaded, fz.State)
        saved = loaded.data.get(host_generators.KEY) if isinstance(loaded.data, dict) else None
        if isinstance(schedule := schedule_of(loaded), Plateau) and isinstance(loaded.data, dict) \
                and plateau.KEY in loaded.data:
            schedule.load_state_dict(loaded.data[plateau.KEY])
        restored, generators = loaded, (loaded.rng, host_generators.setter(saved, checkpoint))
    trainer._load_optimizer_and_scheduler(checkpoint)  # fz's does nothing; a subclass's additions (GRPO's) load
    trainer.state.global_step = int(restored.step)
    position = restored.data.get("loader") if isinstance(restored.data, dict) else None
    if trainer.args.ignore_data_skip and isinstance(position, dict):  # transformers' epochs_trained, from its start
        per_epoch = trainer._max_steps()[1]
        epoch = trainer.state.global_step // per_epoch if per_epoch else int(position["epoch"])
        restored = restored.replace(data={**restored.data, "loader": {**position, "epoch": epoch, "index": 0}})
    if generators is None:
        return restored, None
    torch_rng, host = generators
    device = restored.plan.device

    def set_generators() -> None:
        restore(torch_rng, device)
        if host is not None:
            host()

    return restored, set_generators
