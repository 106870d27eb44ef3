"""Putting a complete checkpoint directory in place (rank 0, the last phase of a save), and
settling what a save cut off there leaves behind.

A save writes `<root>/<name>.tmp/` and renames it to `<root>/<name>` once every file in it is
durable, then `latest` names it with its manifest's checksum. `<name>` is `step_<N>`.

Saving a name that is already committed (a script run twice) replaces it
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
from dataclasses import dataclass
from pathlib import Path

from fz.ckpt import layout
from fz.ckpt.layout import OLD, current, fsync_path, pointer
from fz.errors import CheckpointError

_STEP_OLD = re.compile(r"^(step_\d+)\.old$")


@dataclass(frozen=True)
class Target:
    """Where a save commits: `root/name`."""

    root: Path
    name: str

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
        probe = root / f".fz-write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"fz.save: cannot write the checkpoint directory {root}: {e.strerror or e} "
                              f"({type(e).__name__}); choose a directory this process can create and write") from e
    for p in root.iterdir():
        m = _STEP_OLD.match(p.name)
        if m and p.is_dir():
            settle(root, m.group(1))
    layout.clean_stale(root)
    target.tmp.mkdir()
    fsync_path(root)


def settle(root: Path, name: str) -> None:
    """After a replacing save was cut off: keep the copy a reader takes (`current`) as `name`,
    drop the other."""
    old = root / (name + OLD)
    if not old.is_dir():
        return
    entry = pointer(root)
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
    1-4 above), point `latest` at it, then prune to `keep_last`."""
    root, final, old = target.root, target.final, target.old
    if final.exists():
        os.replace(final, old)
        fsync_path(root)
    os.replace(target.tmp, final)
    fsync_path(root)
    layout.write_latest(root, target.name)
    if old.exists():
        _drop(root, target.name, old)
    if keep_last is not None:
        layout.prune(root, keep_last)
