"""Files read from a checkpoint or weights folder are regular files inside that folder: a FIFO
named like one would block the reader forever, a device would feed it without end, and a
symlink (or a name with '..') could lead anywhere on the machine. Opened without blocking, then
checked with fstat, before a byte is read; JSON nested past Python's recursion limit is refused
by name rather than surfacing as a RecursionError."""
from __future__ import annotations

import errno
import json
import os
import stat
import sys
from io import BufferedReader
from pathlib import Path
from typing import Any

from fz.errors import CheckpointError

NAME_MAX = 255  # bytes of one file name (Linux's)
MAX_DIMS = 64  # dimensions of a tensor's shape read from a file: a model's have a few (errors print shapes)


def inside(folder: Path, file: Path, what: str = "checkpoint file", where: str = "the checkpoint folder") -> Path:
    """`file`, refused unless it (symlinks followed) lies inside `folder` (`where` names it)."""
    try:
        real, root = Path(file).resolve(), Path(folder).resolve()
    except (ValueError, OSError) as e:  # a NUL byte, a name over NAME_MAX, a symlink loop
        raise CheckpointError(f"{what} {str(file)[:200]!r} is not a path that can be read ({e}): not read") from None
    if not real.is_relative_to(root):
        raise CheckpointError(f"{what} {file} leads to {real}, outside {where} {root} "
                              "(a symlink or a name with '..'): not read")
    return file


def plain_name(name: object) -> bool:
    """A file name of the folder itself: no directory part, not '.' or '..', printable (no NUL, no
    terminal control codes a message naming it would print), at most NAME_MAX (255) bytes."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and name.isprintable() and len(name.encode("utf-8", "replace")) <= NAME_MAX)


def _kind(mode: int) -> str:
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a directory" if stat.S_ISDIR(mode) else "not a file")


def stat_regular(path: Path, what: str = "checkpoint file") -> os.stat_result:
    """`path`'s stat (symlinks followed), refused unless it is a regular file: nothing is opened."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{what} {path} is not a regular file ({_kind(st.st_mode)}): not read")
    return st


def open_regular(path: Path, what: str = "checkpoint file") -> int:
    """A read-only descriptor of `path`, which must be a regular file; else a CheckpointError
    naming it and what it is."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CheckpointError(f"{what} {path} cannot be opened ({e.strerror or e})") from e
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CheckpointError(f"{what} {path} is not a regular file ({_kind(mode)}): not read")
    return fd


def open_regular_file(path: Path, what: str = "checkpoint file") -> BufferedReader:
    """open_regular as a binary file object."""
    return os.fdopen(open_regular(path, what), "rb")


def read_small(path: Path, limit: int, what: str) -> bytes:
    """A small file's bytes (a pointer such as `latest`): a regular file of at most `limit` bytes."""
    with open_regular_file(path, what) as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{what} {path} holds more than {limit} bytes: not what it should be")
    return data


JSON_MAX = 256 << 20  # bytes of a checkpoint's metadata file (an index of thousands of ranks is tens of MB)


def read_regular(path: Path, what: str = "checkpoint file", limit: int = JSON_MAX) -> bytes:
    """All of a regular file's bytes, at most `limit` (its size checked before anything is read: a
    sparse file claiming gigabytes is not allocated); FileNotFoundError when there is no such name
    (for the caller to word), a CheckpointError when it is not a regular file or is too big."""
    if not os.path.lexists(path):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
    with open_regular_file(path, what) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > limit:
            raise CheckpointError(f"{what} {path} is {size} bytes, over the {limit >> 20} MiB a checkpoint's metadata "
                                  "file may be: damaged or not what fz wrote")
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{what} {path} holds more than {limit} bytes: not what it should be")
    return data


def _distinct(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are distinct: fz never writes one twice, and json.loads would keep
    the last silently (a second entry for a tensor, a step count, after the one checked)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"the key {twice[:100]!r} appears twice")
    return out


def parse_json(raw: bytes | str, where: str) -> Any:
    """json.loads, with nesting past Python's recursion limit a CheckpointError naming `where`
    (JSON errors, a repeated key among them, stay ValueErrors, which callers word)."""
    try:
        return json.loads(raw, object_pairs_hook=_distinct)
    except RecursionError:
        raise CheckpointError(f"{where} nests deeper than Python's recursion limit ({sys.getrecursionlimit()} "
                              "levels): not read") from None
