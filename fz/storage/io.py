"""The NVMe tier's I/O: a thread pool doing preadv/pwritev (they release the GIL) into a
fixed set of reusable, page-aligned buffers, with O_DIRECT where the filesystem allows it,
so offloaded bytes stay on disk instead of moving into the page cache."""
from __future__ import annotations

import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from fz.storage.blob import Blob, open_blob


def _buffer(nbytes: int, pin: bool) -> Tensor:
    if pin and torch.cuda.is_available():
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # page-aligned host memory
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


class IOPool:
    """`count` buffers of `nbytes` and `threads` I/O threads, for one store (reused across steps)."""

    def __init__(self, count: int, nbytes: int, threads: int, direct: bool, pin: bool):
        self.nbytes, self.direct = nbytes, direct
        self.buffers: list[Tensor] = [_buffer(nbytes, pin) for _ in range(count)]
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fz-offload-io")

    @property
    def resident_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def read(self, blob: Blob, offset: int, length: int, buf: Tensor) -> Future:
        return self.pool.submit(self._io, blob, offset, buf[:length], False)

    def write(self, blob: Blob, offset: int, length: int, buf: Tensor) -> Future:
        return self.pool.submit(self._io, blob, offset, buf[:length], True)

    def _io(self, blob: Blob, offset: int, buf: Tensor, write: bool) -> None:
        flags = (os.O_WRONLY if write else os.O_RDONLY) | (os.O_DIRECT if self.direct else 0)
        fd = open_blob(blob.path, flags)
        try:
            view = buf.numpy().data
            blob.io(fd, view, offset, write)
            if write and not self.direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, offset, len(view), os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
