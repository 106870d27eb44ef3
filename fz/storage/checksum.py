"""Block checksums of an offload file: what is read back is what was written, or an OffloadError.

A disk, another process or a stray `dd` can change an offload file between steps; the
optimizer would then train on the damage (a NaN written there makes every later step skip).
So every file of the NVMe tier is cut into 64 KiB blocks and the xxh3-64 hash of each block is
kept in memory (8 bytes per block: 128 KiB per GiB on disk). A write hashes the bytes it
writes, from the same buffer, in the I/O thread; a read checks the buffer it has just filled,
before anyone sees the values. xxh3 runs at about 29 GB/s on this machine's CPU, zlib's crc32
at 7: with every offloaded byte read and written each step, crc32 cost 4-9% of the NVMe
benchmark's step and xxh3 keeps it near 2% (benchmarks/RESULTS.md).

Writes and reads are at any offset: a block that an access covers only in part (an "edge")
is read whole, checked, patched and hashed again under the file's lock, so two threads
writing neighbouring ranges never lose each other's hash. The bytes never written are zeros
(the file is made with ftruncate), and the table starts with the zero blocks' hashes.
"""
from __future__ import annotations

import errno
import os
import threading
from array import array
from collections.abc import Callable

from xxhash import xxh3_64_intdigest as _hash

from fz.errors import OffloadError

BLOCK = 64 << 10
RawIO = Callable[[int, memoryview, int, str], None]  # (fd, view, byte offset, path): all of view, or OSError


def table_bytes(file_bytes: int) -> int:
    """Host memory of the checksums of a file of `file_bytes` (what fz.estimate predicts)."""
    return 8 * -(-file_bytes // BLOCK)


def _pread_exact(fd: int, n: int, off: int, path: str) -> bytearray:
    out = bytearray(n)
    view, done = memoryview(out), 0
    while done < n:
        got = os.preadv(fd, [view[done:]], off + done)
        if got <= 0:
            raise OffloadError(errno.EIO, f"offload file {path}: ends at byte {off + done}, before {off + n} "
                                          "(truncated by something outside fz)")
        done += got
    return out


class BlockSums:
    """The hash of each block of one file, and the lock its partly covered blocks are patched under."""

    def __init__(self, path: str, nbytes: int):
        self.path, self.nbytes = path, nbytes
        count = -(-nbytes // BLOCK)
        self.hashes = array("Q", [_hash(bytes(BLOCK))]) * count
        if count and nbytes % BLOCK:
            self.hashes[-1] = _hash(bytes(nbytes % BLOCK))
        self.lock = threading.Lock()

    @property
    def table_bytes(self) -> int:
        """Host memory the table takes (what fz.memory_report measures)."""
        return self.hashes.itemsize * len(self.hashes)

    def _span(self, off: int, end: int) -> tuple[int, int]:
        """[lo, hi): the blocks wholly inside [off, end), as byte offsets (the last block ends at the file's end)."""
        lo = off if off % BLOCK == 0 else min(end, (off // BLOCK + 1) * BLOCK)
        hi = end if end % BLOCK == 0 or end == self.nbytes else max(lo, end // BLOCK * BLOCK)
        return lo, hi

    def read(self, fd: int, view: memoryview, off: int, raw_read: RawIO) -> None:
        """Fill `view` from byte `off` (`raw_read` does the I/O) and check every block it touches."""
        end = off + len(view)
        lo, hi = self._span(off, end)
        if hi > lo:
            raw_read(fd, view[lo - off:hi - off], lo, self.path)
            for at in range(lo, hi, BLOCK):
                self._check(at, _hash(view[at - off:min(at + BLOCK, hi) - off]))
        for a, b in ((off, lo), (hi, end)):
            if b > a:
                self._edge(a, view[a - off:b - off], write=False)

    def write(self, fd: int, view: memoryview, off: int, raw_write: RawIO) -> None:
        """Write `view` at byte `off` (`raw_write` does the I/O) and record the sums of the blocks it changes."""
        end = off + len(view)
        lo, hi = self._span(off, end)
        if hi > lo:
            sums = [_hash(view[at - off:min(at + BLOCK, hi) - off]) for at in range(lo, hi, BLOCK)]
            raw_write(fd, view[lo - off:hi - off], lo, self.path)
            self.hashes[lo // BLOCK:lo // BLOCK + len(sums)] = array("Q", sums)
        for a, b in ((off, lo), (hi, end)):
            if b > a:
                self._edge(a, view[a - off:b - off], write=True)

    def _edge(self, at: int, piece: memoryview, write: bool) -> None:
        """Part of one block: the block read whole and checked; then `piece` copied out of it, or
        patched into it, its sum recorded and the piece written."""
        start = at // BLOCK * BLOCK
        n = min(BLOCK, self.nbytes - start)
        with self.lock:
            fd = os.open(self.path, os.O_RDWR if write else os.O_RDONLY)
            try:
                block = _pread_exact(fd, n, start, self.path)
                self._check(start, _hash(block))
                i = at - start
                if not write:
                    piece[:] = block[i:i + len(piece)]
                    return
                block[i:i + len(piece)] = piece
                done = 0
                while done < len(piece):
                    done += os.pwritev(fd, [piece[done:]], at + done)
                self.hashes[start // BLOCK] = _hash(block)
            except OSError as e:
                if isinstance(e, OffloadError):
                    raise
                raise OSError(e.errno, f"offload file {self.path} at byte {start}: {e.strerror}") from e
            finally:
                os.close(fd)

    def _check(self, start: int, got: int) -> None:
        want = self.hashes[start // BLOCK]
        if got != want:
            end = min(start + BLOCK, self.nbytes)
            raise OffloadError(
                errno.EIO,
                f"offload file {self.path}: bytes {start}-{end} changed on disk since fz wrote them (xxh3 "
                f"{got:016x}, written {want:016x}); something outside fz (the disk, another process) wrote there. "
                "The state that holds this file is unusable: restore from the last checkpoint (fz.restore)")
