"""Putting a complete checkpoint directory in place (rank 0, the last phase of a save), and
settling what a save cut off there leaves behind.

A save writes `<root>/<name>.tmp/` and renames it to `<root>/<name>` once every file in it is
durable. `<name>` is `step_<N>` (fz.save and the Checkpointer: `latest` then names it with its
manifest's checksum) or a DeepSpeed tag (fz.deepspeed's save_checkpoint: `latest` holds the tag
alone, as DeepSpeed's does).

Saving a name that is already committed (a script run twice, a tag saved again) replaces it
with a committed copy readable at every moment:

    1. <name>     -> <name>.old   readers take .old while <name> is missing
    2. <name>.tmp -> <name>       readers still take .old while `latest`'s checksum is its
    3. `latest` names the new copy
    4. <name>.old -> <name>.del, then deleted

A crash between any two leaves a copy `fz.restore` reads (fz/ckpt/layout.py: `current`); the
next save to the root keeps that copy as <name> and drops the other (`settle`).
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fz.ckpt import layout
from fz.ckpt.layout import LATEST, MANIFEST, META, OLD, current, fsync_path, pointer, replace_durable
from fz.errors import CheckpointError

_STEP_OLD = re.compile(r"^(step_\d+)\.old$")


@dataclass(frozen=True)
class Target:
    """Where a save commits: `root/name`, and what `latest` says afterwards ("fz": the step and
    its manifest's checksum; "tag": the name alone, DeepSpeed's; "keep": untouched)."""

    root: Path
    name: str
    latest: Literal["fz", "tag", "keep"] = "fz"

    @property
    def final(self) -> Path:
        return self.root / self.name

    @property
    def tmp(self) -> Path:
        return self.root / (self.name + ".tmp")

    @property
    def old(self) -> Path:
        return self.root / (self.name + OLD)


def prepare(target: Target) -> None:
    """Phase 1 on rank 0: the root exists and is writable, a cut-off save's leftovers are settled
    or gone, `<name>.tmp` is empty."""
    root = target.root
    try:
        root.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=root).close()  # a file no one can plant a link for
    except OSError as e:
        raise CheckpointError(f"fz.save: cannot write the checkpoint directory {root}: {e.strerror or e} "
                              f"({type(e).__name__}); choose a directory this process can create and write") from e
    if target.latest == "fz":  # fz's own root: every step's leftovers
        for p in root.iterdir():
            m = _STEP_OLD.match(p.name)
            if m and _folder(p):
                settle(root, m.group(1), fz_pointer=True)
            elif m:  # a file or a symlink no save makes (planted, or by hand): unlinked, never followed
                p.unlink(missing_ok=True)
        layout.clean_stale(root)
    else:  # a DeepSpeed save_dir may hold anything else: the leftovers of fz's saves only
        for p in root.iterdir():
            if _folder(p) and p.name.endswith((".tmp", ".del")) and _ours(p):
                shutil.rmtree(p, ignore_errors=True)
        for p in root.iterdir():
            if _folder(p) and p.name.endswith(OLD) and _ours(p):
                settle(root, p.name[:-len(OLD)], fz_pointer=False)
    try:
        target.tmp.mkdir()
    except FileExistsError:
        raise CheckpointError(f"fz.save: {target.tmp} is in the way ({_what(target.tmp)}, not a leftover of fz's "
                              "saves): this save writes there first; move or delete it, then save again") from None
    fsync_path(root)


def _folder(p: Path) -> bool:
    """A real folder: a symlink to one is not followed (what it points to is not the save_dir's)."""
    return p.is_dir() and not p.is_symlink()


def _what(p: Path) -> str:
    if p.is_symlink():
        return f"a symlink to {os.readlink(p)}"
    return "a folder" if p.is_dir() else "a file"


def _ours(folder: Path) -> bool:
    """A folder a save made in a save_dir shared with others: empty, or holding fz's files or (a
    tag DeepSpeed wrote, set aside by fz saving that tag) DeepSpeed's."""
    return not any(folder.iterdir()) or any((folder / n).exists() for n in (META, MANIFEST, LATEST)) \
        or any(folder.glob("*.distcp")) or any(folder.glob("*model_states.pt"))


def settle(root: Path, name: str, fz_pointer: bool) -> None:
    """After a replacing save was cut off: keep the copy a reader takes (`current`) as `name`,
    drop the other."""
    old = root / (name + OLD)
    if not old.is_dir():
        return
    entry = pointer(root) if fz_pointer else None
    want = entry[1] if entry is not None and entry[0] == name else None
    if current(root, name, want) == old:
        if (root / name).exists():
            _drop(root, name, root / name)
        os.replace(old, root / name)
        fsync_path(root)
    else:
        _drop(root, name, old)


def _drop(root: Path, name: str, path: Path) -> None:
    """Delete `path` after renaming it `<name>.del` (never read), so a crash mid-delete leaves no
    half-deleted directory under a name a reader takes."""
    dead = root / (name + ".del")
    shutil.rmtree(dead, ignore_errors=True)
    os.replace(path, dead)
    fsync_path(root)
    shutil.rmtree(dead, ignore_errors=True)


def into_place(target: Target, keep_last: int | None) -> None:
    """Rename the complete `<name>.tmp` to `<name>` (setting a committed copy aside first, steps
    1-4 above), point `latest` at it, then prune to `keep_last` (fz's layout)."""
    root, final, old = target.root, target.final, target.old
    if final.exists():
        os.replace(final, old)
        fsync_path(root)
    os.replace(target.tmp, final)
    fsync_path(root)
    if target.latest == "fz":
        layout.write_latest(root, target.name)
    elif target.latest == "tag":
        replace_durable(root / LATEST, target.name.encode())
    if old.exists():
        _drop(root, target.name, old)
    if keep_last is not None and target.latest == "fz":
        layout.prune(root, keep_last)
