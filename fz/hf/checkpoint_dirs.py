"""`checkpoint-N/` folders of fz.hf.Trainer: complete or absent, whatever crashes in between.

A save writes everything (fz's checkpoint, then `trainer_state.json`, the config and the
tokenizer) into `tmp-checkpoint-N/` and renames it to `checkpoint-N` last, so
transformers' `get_last_checkpoint` (the highest `checkpoint-N`) never finds a half-written
folder: a crash leaves only the `tmp-` folder, which the next save of that step clears. A
step saved again (a run resumed from an earlier checkpoint) replaces the old folder only once
the new one is complete. Resuming takes the highest complete folder; a path that is not one
is an error listing the folders that are.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from fz.errors import ConfigError

log = logging.getLogger(__name__)
FZ_DIR = "fz"  # fz's checkpoint inside a checkpoint-N folder
STATE_FILE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME
STAGING = "tmp-"  # tmp-checkpoint-N: a save in progress (never matched by get_last_checkpoint)
_NUMBERED = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)")


def is_checkpoint_name(name: str) -> bool:
    """Whether `name` is a `checkpoint-N` folder's name."""
    return _NUMBERED.fullmatch(name) is not None


def number(name: str) -> int | None:
    """N of a `checkpoint-N` folder's name (None: another name)."""
    m = _NUMBERED.fullmatch(name)
    return int(m.group(1)) if m else None


def staging_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, f"{STAGING}{PREFIX_CHECKPOINT_DIR}-{step}")


def clear_staging(run_dir: str, step: int) -> None:
    """Before a save, on the rank that writes: what a crashed save of this step left (a link or a
    file of that name removed itself: a save never writes through it to where it leads)."""
    _remove(staging_dir(run_dir, step))


def _remove(path: str, blocking: bool = True) -> None:
    """`path` gone: a folder with what is in it, a link or a file itself (never what a link leads to).
    Where it stays (an NFS silly-rename file held open), a ConfigError if it is in a new save's way
    (`blocking`), else a warning, as transformers' rotation ignores it."""
    try:
        if os.path.islink(path) or os.path.isfile(path):
            os.unlink(path)
        else:
            shutil.rmtree(path, ignore_errors=True)
    except FileNotFoundError:
        pass
    if os.path.lexists(path):
        if blocking:
            raise ConfigError(f"fz.hf.Trainer: {path} is in the way of a checkpoint and cannot be removed")
        log.warning("fz.hf.Trainer: %s could not be removed whole; it stays", path)


def final_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")


def publish(run_dir: str, step: int) -> str:
    """The complete `tmp-checkpoint-N` renamed to `checkpoint-N` (an older one replaced only then)."""
    staging, final = staging_dir(run_dir, step), final_dir(run_dir, step)
    _fsync_tree(staging)
    old = None
    if os.path.lexists(final):
        old = f"{staging}.replaced"
        _remove(old)
        os.rename(final, old)  # the complete old copy stays until the new one is in place
    os.rename(staging, final)
    _fsync(run_dir)
    if old is not None:
        _remove(old, blocking=False)
    return final


WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")  # save_only_model's


def complete(folder: str | Path) -> bool:
    """A published checkpoint: fz's checkpoint, DeepSpeed's (transformers + DeepSpeed wrote it), or
    (save_only_model) the weights, with the trainer state."""
    folder = Path(folder)
    held = (folder / FZ_DIR).is_dir() or written_by_deepspeed(folder) is not None or \
        any((folder / w).is_file() for w in WEIGHTS)
    return held and (folder / STATE_FILE).is_file()


def numbered(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(N, path) of every `checkpoint-N` folder in `run_dir`, by N; a link of that name is none
    (it may lead out of the run: resuming, rotating and keeping the best never follow one)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for p in run_dir.iterdir():
        m = _NUMBERED.fullmatch(p.name)
        if m and p.is_dir() and not p.is_symlink():
            found.append((int(m.group(1)), p))
        elif m and p.is_symlink():
            log.warning("fz.hf.Trainer: %s is a link, not a checkpoint of this run: passed over", p)
    return sorted(found)


def rotate(run_dir: str, limit: int | None, keep: str | None = None) -> None:
    """Keep `limit` complete checkpoints (save_total_limit), as transformers does: the oldest go
    first, never the newest nor `keep` (the best one, `best_model_checkpoint`)."""
    if not limit or limit <= 0:
        return
    done = [p for _, p in numbered(run_dir) if complete(p)]
    if not done:
        return
    protected = {done[-1].resolve()} | ({Path(keep).resolve()} if keep and Path(keep).resolve() in
                                        {p.resolve() for p in done} else set())
    remaining = len(done)
    for path in done:
        if remaining <= max(limit, len(protected)):
            break
        if path.resolve() not in protected:
            log.info("fz.hf.Trainer: deleting %s (save_total_limit=%d)", path, limit)
            _remove(str(path), blocking=False)
            remaining -= 1


def to_resume(checkpoint: str | bool, output_dir: str) -> str:
    """The folder `resume_from_checkpoint` names: with True the highest complete `checkpoint-N` of
    `output_dir`; a path must be a complete checkpoint of fz.hf.Trainer (or of transformers +
    DeepSpeed, fz/hf/deepspeed_resume.py). Else a ConfigError listing the ones there are."""
    if checkpoint is True:
        found = numbered(output_dir)
        done = [(n, p) for n, p in found if complete(p)]
        for n, p in found:
            if not complete(p) and (not done or n > done[-1][0]):
                log.warning("fz.hf.Trainer: %s is incomplete (no %s or %s/); resuming from an earlier one", p,
                            STATE_FILE, FZ_DIR)
        if not done:
            raise ConfigError(f"fz.hf.Trainer: resume_from_checkpoint=True, but {output_dir} holds no complete "
                              f"checkpoint-N folder{_listing(output_dir)}")
        return str(done[-1][1])
    folder = Path(str(checkpoint))
    if complete(folder):
        return str(folder)
    if not folder.is_dir():
        why = "does not exist"
    elif (folder / STATE_FILE).is_file():
        why = f"holds no fz checkpoint ({FZ_DIR}/): it was not written by fz.hf.Trainer"
    else:
        why = f"is not a complete fz.hf.Trainer checkpoint (no {STATE_FILE}" + \
              ("" if (folder / FZ_DIR).is_dir() else f", no {FZ_DIR}/") + ")"
    places = [str(folder)] + ([output_dir] if Path(output_dir).resolve() != folder.resolve() else [])
    listed = "".join(_listing(p) for p in places) or " (no checkpoint-N folders in " + " or ".join(places) + ")"
    raise ConfigError(f"fz.hf.Trainer: resume_from_checkpoint={str(checkpoint)!r} {why}; pass a checkpoint-N "
                      f"folder, or resume_from_checkpoint=True for the last one{listed}")


def written_by_deepspeed(folder: str | Path) -> str | None:
    """The tag folder of a checkpoint-N that transformers + DeepSpeed wrote (its `latest` and
    global_stepN/), or None."""
    folder = Path(folder)
    tags = sorted(p.name for p in folder.glob("global_step*") if p.is_dir())
    return tags[-1] if tags and (folder / "latest").is_file() else None


def _listing(run_dir: str | Path) -> str:
    found = numbered(run_dir)
    if not found:
        return ""
    shown = ", ".join(f"{p.name}{'' if complete(p) else ' (incomplete)'}" for _, p in found[-8:])
    return f"; {run_dir} has: {shown}"


def _fsync(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    """The small files the Trainer wrote (fz's checkpoint fsyncs its own) on disk before the rename."""
    for folder, dirs, files in os.walk(root):
        if folder == root and FZ_DIR in dirs:
            dirs.remove(FZ_DIR)
        for name in files:
            _fsync(os.path.join(folder, name))
        _fsync(folder)
