"""`Blob`: one raw file of the offload store, read and written by byte ranges, checksummed.

Below everything else in fz/storage/: the store makes blobs, the I/O pool and the gate act on
them, DiskTensor names ranges of one; a blob knows them only by what it calls (the Protocols
here), so no file of the package imports one that imports it back.
"""
from __future__ import annotations

import errno
import os
import stat
import weakref
from typing import Protocol

import torch
from torch import Tensor

from fz.errors import ConfigError, OffloadError
from fz.storage.checksum import BlockSums
from fz.storage.scratch import SCRATCH

Extents = tuple[tuple[int, int], ...]  # (byte offset, byte length) in the blob, in order


class Maker(Protocol):
    """What made a blob (fz/storage/store.py's DiskStore): its directory, and another blob in it."""

    dir: str

    def new_blob(self, kind: str, nbytes: int) -> Blob: ...


class Holder(Protocol):
    """A background update writing a blob (fz/storage/gate.py's Gate): a read waits for it."""

    def wait(self, blob: Blob) -> None: ...


class Blob:
    """One raw file of the offload store; the file is removed when the last DiskTensor on it goes."""

    group_bytes: int  # optimizer-state blobs only: the bytes streamed as one group (fz/offload/move.py)
    gate: Holder | None = None  # set while a background update writes this file (fz/storage/gate.py)

    def __init__(self, store: Maker, path: str, nbytes: int):
        self.store, self.path, self.nbytes = store, path, nbytes
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            raise ConfigError(f"offload: cannot create {path}: {e.strerror}") from e
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        self.sums = BlockSums(path, nbytes)  # every read is checked against what was written
        self._finalizer = weakref.finalize(self, _unlink, path)

    def remove_now(self) -> None:
        """Delete the file before the last reference goes (a donated state's old values: the step
        that consumed it has read them)."""
        self._finalizer()

    def ready(self) -> None:
        """Returns once no background update is writing this file (at once, nearly always)."""
        gate = self.gate
        if gate is not None:
            gate.wait(self)

    def read(self, extents: Extents, wait: bool = True, pooled: bool = False) -> Tensor:
        """The bytes of `extents`, concatenated, as a new uint8 tensor (buffered I/O). `wait=False`
        only for the update that holds this file's gate; `pooled`: into a buffer of the step's
        pool (fz/storage/scratch.py), for reads the step lets go of (a gather's input)."""
        if wait:
            self.ready()
        n = sum(n for _, n in extents)
        out = SCRATCH.empty(n, torch.uint8) if pooled else torch.empty(n, dtype=torch.uint8)
        self._each(False, extents, out)
        return out

    def write(self, extents: Extents, data: Tensor, wait: bool = True) -> None:
        """`data` into `extents`; `wait=False` only for the update that holds this file's gate."""
        if wait:
            self.ready()
        self._each(True, extents, data.reshape(-1).view(torch.uint8))

    def io(self, fd: int, view: memoryview, off: int, write: bool) -> None:
        """All of `view` written at, or read from, byte `off` of this file through `fd`, checksummed."""
        if write:
            self.sums.write(fd, view, off, _pwrite_full)
        else:
            self.sums.read(fd, view, off, _pread_full)

    def _each(self, write: bool, extents: Extents, data: Tensor) -> None:
        """Consecutive pieces of `data` written to, or read from, each extent."""
        view, at = data.numpy().data, 0
        fd = self._open(os.O_WRONLY if write else os.O_RDONLY)
        try:
            for off, n in extents:
                self.io(fd, view[at:at + n], off, write)
                at += n
        finally:
            os.close(fd)

    def _open(self, flags: int) -> int:
        return open_blob(self.path, flags)

    def __repr__(self) -> str:
        return f"Blob({self.path!r}, {self.nbytes:,} bytes)"


def open_blob(path: str, flags: int) -> int:
    """A descriptor of the offload file `path`, which must still be the regular file fz made: a FIFO,
    a device or a link put in its place is an OffloadError, never waited on (O_NONBLOCK) or followed."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OffloadError(e.errno, f"offload file {path} was replaced by a link: not followed") from None
        raise OSError(e.errno, f"offload file {path}: {e.strerror}") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OffloadError(errno.EIO, f"offload file {path} was replaced by something that is not a regular file: "
                                      "not read")
    return fd


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _full(fd: int, view: memoryview, off: int, path: str, write: bool) -> None:
    """All of `view` read from or written to `fd` at byte `off` (preadv/pwritev may do part)."""
    what, call = ("write", os.pwritev) if write else ("read", os.preadv)
    done = 0
    while done < len(view):
        try:
            n = call(fd, [view[done:]], off + done)
        except OSError as e:
            raise OSError(e.errno, f"offload {what} of {path} at byte {off + done}: {e.strerror}") from e
        if n <= 0:
            raise OffloadError(errno.EIO, f"offload {what} of {path} at byte {off + done}: the file ends early "
                                          "(truncated)")
        done += n


def _pread_full(fd: int, view: memoryview, off: int, path: str) -> None:
    _full(fd, view, off, path, False)


def _pwrite_full(fd: int, view: memoryview, off: int, path: str) -> None:
    _full(fd, view, off, path, True)


def sub_extents(extents: Extents, start: int, length: int) -> Extents:
    """The byte range [start, start + length) of the concatenation of `extents`."""
    out: list[tuple[int, int]] = []
    at = 0
    for off, n in extents:
        lo, hi = max(start, at), min(start + length, at + n)
        if lo < hi:
            out.append((off + lo - at, hi - lo))
        at += n
    return tuple(out)
