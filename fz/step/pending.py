"""The disk tier's update still streaming after `fz.train_step` returned: one per process.

At stage 3 with parameters and optimizer state on disk, the step's update reads, updates and
writes every group of the optimizer state in files, which takes as long as the disk needs.
The next step's forward does not wait for all of it: the update runs on in a thread, writing
in place, and each file it writes is gated until its last byte is on disk (fz/storage/gate.py),
so the forward's first gathers start as soon as the first buckets are written, in the order
the update writes them (bucket order: the first units first). The results are the same bytes
as a step that waited: the same operations on the same values, only later.

The next step's backward (whose gradients would need memory the update still holds), its
update, and any offload change wait for it (`join_inflight`); a failure in the thread fails
them and every read of a gated file, naming the cause.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

from fz.errors import OffloadError
from fz.storage.gate import DEADLINE_S, Gate


class InFlight:
    """One background update: its thread, its gate, and what runs once it is joined."""

    def __init__(self, gate: Gate, run: Callable[[], None], after: Callable[[], None] | None):
        self.gate, self.after = gate, after
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, args=(run,), name="fz-disk-update")
        self.thread.start()

    def _main(self, run: Callable[[], None]) -> None:
        try:
            run()
        except BaseException as e:  # noqa: BLE001  # handed to whoever waits: the gate's readers, the join
            self.error = e
            self.gate.fail(e)

    def join(self) -> None:
        self.thread.join(DEADLINE_S)
        if self.thread.is_alive():
            raise OffloadError(f"{self.gate.what} has not finished after {DEADLINE_S:.0f} s")
        if self.after is not None:
            self.after()
        if self.error is not None and not self.gate.reported:  # else a read of its files has raised it
            raise OffloadError(f"{self.gate.what} failed ({type(self.error).__name__}: {self.error}); the state it "
                               "wrote is unusable: restore from the last checkpoint (fz.restore)") from self.error


_inflight: InFlight | None = None
_lock = threading.Lock()


def start_inflight(gate: Gate, run: Callable[[], None], after: Callable[[], None] | None) -> None:
    """Run `run` in the background (`after` once it is joined); any update still running is joined first."""
    global _inflight
    join_inflight()
    with _lock:
        _inflight = InFlight(gate, run, after)


def join_inflight() -> None:
    """Wait for the background update, if any (its failure raised here, once)."""
    global _inflight
    with _lock:
        job, _inflight = _inflight, None
    if job is not None:
        job.join()


def inflight() -> bool:
    """Whether an update is still streaming (for tests and the benchmark's time split)."""
    job = _inflight
    return job is not None and job.thread.is_alive()
