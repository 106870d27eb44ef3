"""How a checkpoint's data files reach the disk: large aligned O_DIRECT writes, hashed as written.

DCP's FileSystemWriter writes each file through a buffered Python file and fsyncs it; fz
then read every file back to checksum it for the manifest. On the machine of
benchmarks/RESULTS.md buffered writes + fsync run at a fraction of O_DIRECT's bandwidth, and the
read-back was a second pass over every byte. Here the stream DCP writes into copies the bytes
into a page-aligned buffer, hashes them on the way in (the manifest's checksum, so nothing is
read back) and writes each full buffer with O_DIRECT from a second thread while the caller
fills the next: the page cache is bypassed, so the one fsync per file has only the file's size
and blocks to flush. The last, partial block is padded
and the file truncated to its length. A filesystem that refuses O_DIRECT (tmpfs) gets the same
buffer written without it.
"""
from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Generator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem

from fz.ckpt.manifest import hasher
from fz.compat import FileSystemWriter

BUFFER = 16 << 20  # bytes per O_DIRECT write: large enough that the device, not the syscall, sets the pace
_ALIGN = 4096  # O_DIRECT needs offsets, lengths and addresses aligned to the logical block (<= 4 KiB)


def _open(path: Path) -> tuple[int, bool]:
    """A new file for writing, O_DIRECT where the filesystem allows it; (fd, direct)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o644), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644), False


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        n = os.write(fd, view)
        view = view[n:]


class HashingFile:
    """The write-only binary file DCP's writer writes into (write/tell/flush/fileno/close).

    Two buffers: while one is written (a thread; os.write releases the GIL), the caller fills
    the other, so copying and hashing overlap the device's time."""

    def __init__(self, path: Path, algorithm: str):
        self.path = path
        self.fd, self.direct = _open(path)
        self.hash = hasher(algorithm)
        self.bufs = [mmap.mmap(-1, BUFFER) for _ in range(2)]  # anonymous: page-aligned, as O_DIRECT needs
        self.views = [memoryview(b) for b in self.bufs]
        self.view = self.views[0]  # the one being filled
        self.fill = 0  # bytes in it
        self.pos = 0  # bytes written by the caller
        self.io = ThreadPoolExecutor(1, thread_name_prefix="fz-ckpt-write")
        self.pending: Future | None = None  # the other buffer's write
        self.closed = False
        self.padded = False  # the file's last block went out padded: it is complete

    def write(self, data: Any) -> int:
        src = memoryview(data).cast("B")
        n = len(src)
        if self.padded:
            raise ValueError(f"{self.path}: written to after its padded end")
        self.hash.update(src)
        while src:
            k = min(len(src), BUFFER - self.fill)
            self.view[self.fill:self.fill + k] = src[:k]
            self.fill += k
            src = src[k:]
            if self.fill == BUFFER:
                self._wait()
                self.pending = self.io.submit(_write_all, self.fd, self.view)
                self.view = self.views[1] if self.view is self.views[0] else self.views[0]
                self.fill = 0
        self.pos += n
        return n

    def _wait(self) -> None:
        """The previous buffer's write is done (its error, if any, raised here)."""
        if self.pending is not None:
            done, self.pending = self.pending, None
            done.result()

    def tell(self) -> int:
        return self.pos

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        """Nothing: the buffer goes out whole, or at close (DCP flushes after every item)."""

    def fileno(self) -> int:
        """What DCP fsyncs: the tail is written first, so the fsync covers every byte."""
        self._drain()
        return self.fd

    def _drain(self) -> None:
        """Write all that is buffered; O_DIRECT pads the tail to the block, then cuts the file back."""
        self._wait()
        n = self.fill
        if not n:
            return
        if self.padded:
            raise ValueError(f"{self.path}: written to after its padded end")
        end = -(-n // _ALIGN) * _ALIGN if self.direct else n
        self.view[n:end] = bytes(end - n)
        _write_all(self.fd, self.view[:end])
        self.fill = 0
        if end != n:
            self.padded = True
            os.ftruncate(self.fd, self.pos)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._drain()
        finally:
            self._release()

    def abort(self) -> None:
        """Close without writing the rest (the save failed: its own error is the one to report)."""
        self.fill = 0
        with suppress(OSError):
            self.close()

    def _release(self) -> None:
        self.io.shutdown(wait=True)
        os.close(self.fd)
        for v, b in zip(self.views, self.bufs):
            v.release()
            b.close()

    def digest(self) -> str:
        return self.hash.hexdigest()


class _HashingFileSystem(FileSystem):
    """DCP's local filesystem whose files for writing are HashingFiles; records each one's
    {"size", "checksum", "algorithm"} by file name once it is closed whole."""

    def __init__(self, algorithm: str):
        super().__init__()
        self.algorithm = algorithm
        self.sums: dict[str, dict] = {}
        self.lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        f = HashingFile(Path(path), self.algorithm)
        try:
            yield f
        except BaseException:
            f.abort()
            raise
        f.close()
        with self.lock:
            self.sums[Path(path).name] = {"size": f.pos, "checksum": f.digest(), "algorithm": self.algorithm}


class HashingWriter(FileSystemWriter):
    """fz's storage writer: DCP's, through HashingFiles; `sums()` gives the manifest's entries
    for every file it wrote, without reading one back."""

    def __init__(self, path: Path, algorithm: str, thread_count: int = 1):
        super().__init__(path, sync_files=True, thread_count=thread_count)
        self.hashing = _HashingFileSystem(algorithm)
        self.fs = self.hashing

    def sums(self) -> dict[str, dict]:
        with self.hashing.lock:
            return dict(self.hashing.sums)
