"""`Gate`: files a background update is still writing; a read of one waits for it.

The disk tier's update can stream on after `fz.train_step` has returned (fz/step/pending.py),
so the next step's forward starts on the first blocks while the last ones are still being
updated. The returned state's leaves already name their files (the update writes in place),
like a JAX array under async dispatch: its values are a future. Each file being written holds
this gate until its last byte is on disk; any read or write of it through a DiskTensor (the
gather, `fz.save`, `full_params`, a user's `.load()`) waits for that file alone, with a
deadline, and a failed update is raised to whoever reads, naming the cause.
"""
from __future__ import annotations

import errno
import threading
from collections.abc import Iterable

from fz.errors import OffloadError
from fz.storage.blob import Blob

DEADLINE_S = 3600.0  # an update streams one rank's whole optimizer state; a disk this slow has failed


class Gate:
    """The files one background update writes; each is released when its bytes are written."""

    def __init__(self, blobs: Iterable[Blob], what: str, deadline_s: float = DEADLINE_S):
        self.what, self.deadline_s = what, deadline_s
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.reported = False  # a reader was told of the failure (the update's join need not tell it again)
        self.left: dict[int, Blob] = {}
        for blob in blobs:
            self.left[id(blob)] = blob
            blob.gate = self

    def release(self, blob: Blob) -> None:
        """`blob` is written: its readers go on."""
        with self.cond:
            if self.left.pop(id(blob), None) is not None and blob.gate is self:
                blob.gate = None
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The update failed: every file still held stays held, and its readers get `error`."""
        with self.cond:
            self.error = error
            self.cond.notify_all()

    def wait(self, blob: Blob) -> None:
        """Until `blob` is written (an OffloadError if the update failed or the deadline passed)."""
        with self.cond:
            done = self.cond.wait_for(lambda: self.error is not None or id(blob) not in self.left, self.deadline_s)
            if id(blob) not in self.left:
                return
            if self.error is not None:
                self.reported = True
                raise OffloadError(errno.EIO, f"offload file {blob.path}: {self.what} failed while writing it "
                                              f"({type(self.error).__name__}: {self.error}); the state that holds "
                                              "it is unusable: restore from the last checkpoint (fz.restore)"
                                   ) from self.error
            if not done:
                raise OffloadError(errno.ETIMEDOUT, f"offload file {blob.path}: {self.what} has not finished "
                                                    f"writing it after {self.deadline_s:.0f} s")
