"""The function API, `fz.save` / `fz.restore`, as thin wrappers over a Checkpointer that shares one
process group with every other call; and `save_tag`, a checkpoint in DeepSpeed's layout
(`<save_dir>/<tag>/` and a `latest` holding the tag), for fz.deepspeed's save_checkpoint.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from fz.ckpt import arguments, signing
from fz.ckpt.checkpointer import Checkpointer, wait_for_checkpoints
from fz.ckpt.commit import Target
from fz.ckpt.deepspeed import files as ds_files
from fz.ckpt.deepspeed.importer import import_deepspeed
from fz.ckpt.group import GroupCache
from fz.ckpt.layout import LATEST, PathLike
from fz.errors import ConfigError
from fz.state import State, expect_state

_FUNCTION_GROUPS = GroupCache()


def save(state: State, path: PathLike, *, step: int | None = None, client_state: dict[str, Any] | None = None,
         async_: bool = False, keep_last: int | None = None, client_state_per_rank: bool = False,
         key: signing.Key = None, verbose: bool = True) -> None:
    """Write `state` (and `client_state`) to `<path>/step_<N>`; every rank calls it.

    N is `step` or the state's step. `client_state` (a JSON-able dict, tensors allowed) must be
    the same on every rank (a ConfigError names the keys that differ), unless
    `client_state_per_rank=True` saves each rank's own. `keep_last=K` deletes older steps
    once this one is committed.
    `async_=True` returns once the state is copied to host memory and finishes in the
    background on a checkpoint-only process group; the next save or restore and
    interpreter exit wait for it. Call `wait_for_checkpoints()` before
    `dist.destroy_process_group()`, which would cut it off. `key` (else FZ_CKPT_KEY) signs it.
    `verbose=False` leaves out the saved line.
    """
    state, path = arguments.state_and_path("fz.save", state, path)
    expect_state(state, "fz.save")
    wait_for_checkpoints()
    ckpt = Checkpointer._for_functions(path, keep_last, async_, _FUNCTION_GROUPS, key, verbose)
    ckpt.save(state, step=step, client_state=client_state, client_state_per_rank=client_state_per_rank)


def restore(state: State, path: PathLike, *, step: int | None = None, strict: bool = True,
            with_client_state: bool = False, key: signing.Key = None, verbose: bool = True,
            allow_nonfinite: bool = False) -> State | tuple[State, dict[str, Any]]:
    """Load the checkpoint `path` names (its `latest`, or `step`) into the template `state`.

    The state comes first, as in fz.save (fz/ckpt/arguments.py says why); fz 0.1's
    `restore(path, state)` still works and warns. Every rank calls it. A damaged checkpoint
    (missing, truncated or corrupted file) or one of another model raises ConfigError; with
    strict=False the tensors both share are loaded and the rest is reported as a
    PartialRestoreWarning. With `key` (else FZ_CKPT_KEY) a checkpoint that this key did not
    sign is refused. `with_client_state=True` returns (state, client_state); `verbose=False`
    leaves out the restored line. A checkpoint DeepSpeed wrote (its save_dir, or a tag folder;
    `step` N reads tag global_stepN) is imported: fz.import_deepspeed. A NaN or inf in the
    weights or optimizer moments is fz.NonFiniteError naming them (allow_nonfinite=True: a warning).
    """
    state, path = arguments.state_and_path("fz.restore", state, path, old_order=True)
    expect_state(state, "fz.restore")
    wait_for_checkpoints()
    if ds_files.is_deepspeed(Path(path)):  # one DeepSpeed wrote: fz.import_deepspeed
        new, client = import_deepspeed(state, path, tag=ds_files.unsigned_tag(Path(path), step, key), strict=strict,
                                       allow_nonfinite=allow_nonfinite)
        return (new, client) if with_client_state else new
    ckpt = Checkpointer._for_functions(path, groups=_FUNCTION_GROUPS, key=key, verbose=verbose)
    return ckpt._restore(state, step, strict, with_client_state, stacklevel=4, allow_nonfinite=allow_nonfinite)


def save_tag(state: State, save_dir: PathLike, tag: str, *, client_state: dict[str, Any] | None = None,
             client_state_per_rank: bool = False, latest: bool = True, verbose: bool = True) -> Path:
    """Write `state` as `<save_dir>/<tag>/` (DeepSpeed's layout: the tag folder is the checkpoint)
    and, with `latest`, `<save_dir>/latest` holding the tag, as DeepSpeed's does; every rank calls
    it. A tag already saved is replaced, its old copy readable until the new one is committed.
    `fz.restore` reads the tag folder or the save_dir. Returns the tag folder."""
    expect_state(state, "save_checkpoint")
    if not isinstance(tag, str) or not tag or "/" in tag or tag in (".", "..", LATEST) \
            or tag.endswith((".tmp", ".old", ".del")):
        raise ConfigError(f"save_checkpoint tag={tag!r}: a tag is one folder name (e.g. 'global_step100'), not "
                          f"{LATEST!r} and not ending in .tmp, .old or .del (the names of a save in progress)")
    wait_for_checkpoints()
    target = Target(Path(save_dir), tag, "tag" if latest else "keep")
    ckpt = Checkpointer._for_functions(save_dir, groups=_FUNCTION_GROUPS, verbose=verbose)
    ckpt._save(state, None, client_state, client_state_per_rank, target)
    return target.final
