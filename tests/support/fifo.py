"""A FIFO with a writer waiting on it, for tests that a reader refuses it unread: a reader that
opened it blocking would get a few bytes and an end instead of hanging the test."""
from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def fed_fifo(path: Path) -> Iterator[Path]:
    """mkfifo `path` with a writer thread waiting to open it; the writer is released on exit."""
    os.mkfifo(path)

    def feed() -> None:
        try:
            with open(path, "wb") as w:
                w.write(b"\xff" * 16)
        except (BrokenPipeError, FileNotFoundError):
            pass

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    try:
        yield path
    finally:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # lets a writer still waiting to open go on
        t.join(10)
        os.close(fd)
