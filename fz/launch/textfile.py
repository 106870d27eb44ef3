"""The small text files `fz run` reads, a hostfile and `.fz_env` / `.deepspeed_env`: regular
files only (a FIFO would block the read forever, a device never ends), opened without blocking
and checked with fstat before a byte is read, at most MAX_BYTES long, UTF-8 (a BOM is skipped).
Every failure is a ConfigError naming the file (and the line, for text that is not UTF-8).
fz.ckpt.regular does the same for checkpoints, with CheckpointError; this stays apart so that
the launcher imports nothing of fz's training side."""
from __future__ import annotations

import codecs
import os
import stat
from pathlib import Path

from fz.errors import ConfigError

MAX_BYTES = 1 << 20  # a hostfile or env file is a few lines; a MiB is thousands of hosts


def _kind(mode: int) -> str:
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a directory" if stat.S_ISDIR(mode) else "not a file")


def read_text(path: str | Path, what: str) -> str:
    """The text of `path`, a regular file; `what` names it in errors ("hostfile", "env file")."""
    name = f"{what} {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigError(f"{name} does not exist") from None
    except OSError as e:
        raise ConfigError(f"{name} cannot be opened ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ConfigError(f"{name} is not a regular file ({_kind(mode)}): not read; give a text file")
        raw = f.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"{name} is over {MAX_BYTES >> 20} MiB: not a {what}; check the path")
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8):]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{name}, line {line}: byte {raw[e.start]:#04x} is not UTF-8 text; save the file as "
                          "UTF-8") from None
