"""Files read from a checkpoint or weights folder are regular files: a FIFO named like one would
block the reader forever, a device would feed it without end. Opened without blocking, then
checked with fstat, before a byte is read."""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from fz.errors import CheckpointError


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
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "a directory" if stat.S_ISDIR(mode) else "not a file")
        raise CheckpointError(f"{what} {path} is not a regular file ({kind}): not read")
    return fd


def open_regular_file(path: Path, what: str = "checkpoint file") -> BinaryIO:
    """open_regular as a binary file object."""
    return os.fdopen(open_regular(path, what), "rb")


def read_small(path: Path, limit: int, what: str) -> bytes:
    """A small file's bytes (a pointer such as `latest`): a regular file of at most `limit` bytes."""
    with open_regular_file(path, what) as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{what} {path} holds more than {limit} bytes: not what it should be")
    return data
