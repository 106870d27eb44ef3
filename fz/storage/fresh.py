"""Files and folders fz makes in a folder others may write to (an output, checkpoint or log
folder): whatever already has the name (a file, a planted symlink) is removed, never followed,
so a write never lands where a planted link leads."""
from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def remove_entry(path: str | Path) -> None:
    """Whatever has the name `path`: a folder removed with its contents, anything else (a file, a
    symlink, to a folder too) unlinked without following it; nothing if there is none."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def fresh_dir(path: str | Path) -> Path:
    """An empty folder `path`, made anew (a leftover of that name removed first, a link unfollowed)."""
    path = Path(path)
    remove_entry(path)
    path.mkdir()
    return path


def open_fresh(path: str | Path, mode: str = "wb", **kwargs: Any) -> IO[Any]:
    """`path` opened for writing as a new file (O_EXCL | O_NOFOLLOW), whatever had its name removed
    first, never followed."""
    if not mode.startswith("w"):
        raise ValueError(f"open_fresh writes a new file: mode {mode!r}")
    path = Path(path)
    if path.is_symlink() or path.exists():
        path.unlink()  # a folder of that name fails here: IsADirectoryError names it
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    return open(fd, mode, **kwargs)


@contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """A new file beside `path` to write (a random name, made new: none planted), renamed onto
    `path` once the block ends (replacing whatever had its name, a link too, never following it);
    removed if the block fails."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))  # the umask applies
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
