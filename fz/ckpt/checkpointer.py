"""`fz.Checkpointer`: the checkpoints of one run under one root (orbax's CheckpointManager
is the model), and `fz.wait_for_checkpoints`; `fz.save` / `fz.restore` wrap it
(fz/ckpt/functions.py).

    with fz.Checkpointer("ckpt", keep_last=3, async_=True) as ckpt:
        if ckpt.latest_step() is not None:
            state = ckpt.restore(state)
        ...
        ckpt.save(state)            # returns once staged; commits in the background
    # leaving the block waits for the last save and raises its error

A Checkpointer owns its pending async save (its next save, restore, wait() or close()
waits for it) and its own gloo process group, so two Checkpointers can have saves in
flight at once without their background collectives interleaving on one group.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from fz.background import on_next_call
from fz.ckpt import loader, manifest, saver, signing
from fz.ckpt.commit import Target
from fz.ckpt.group import GroupCache, state_ranks
from fz.ckpt.layout import META, PathLike, committed_steps, read_json, read_latest, resolve, step_name
from fz.distributed import guards, peers
from fz.distributed.arrival import arrive
from fz.errors import CheckpointError, ConfigError
from fz.log import logger
from fz.state import State, expect_state

_lock = threading.Lock()
# Checkpointers with an async save nobody has waited for yet. Strong references: a
# Checkpointer dropped right after save(async) still commits, and its error still surfaces
# in wait_for_checkpoints() (and at exit).
_unwaited: set[Checkpointer] = set()


class _Pending:
    """One async save in flight: DCP's write (dcp.async_save's thread), then fz's commit in a
    thread of its own, because phases 3-4 run collectives and must follow the write."""

    def __init__(self, job: saver.SaveJob, done=None):
        self.error: BaseException | None  # _finish's, if the save failed
        self.step, self.error, self.done = job.step, None, done
        self.where = job.target.final
        written = job.launch()
        self.thread = threading.Thread(target=self._finish, args=(job, written), name=f"fz-ckpt-{job.step}",
                                       daemon=False)
        self.thread.start()

    def _finish(self, job: saver.SaveJob, written: Future) -> None:
        try:
            with peers.translated():  # a peer lost in DCP's or the commit's collectives is a PeerError
                job.finish(written)
        except BaseException as e:  # noqa: BLE001 - re-raised by wait()
            self.error = e
            return
        if self.done is not None:
            self.done()

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error

    @property
    def failed(self) -> bool:
        return self.error is not None and not self.thread.is_alive()


def _note(err: BaseException, text: str) -> None:
    if hasattr(err, "add_note"):  # Python >= 3.11
        err.add_note(text)


def _check_keep_last(keep_last: int | None, who: str) -> None:
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ConfigError(f"{who} keep_last={keep_last!r}: must be None or an integer >= 1")


class Checkpointer:
    """Saves to and restores from `root/step_<N>`; every rank makes the same calls in the same order.

    `keep_last=K` deletes older steps once a newer one is committed. `async_=True` makes
    `save` return once the state is copied to host memory; the write and the commit finish
    in the background. Call `wait()` (or `close()`, or leave the `with` block) before
    `dist.destroy_process_group()`, which would cut a pending save off. With `verbose`
    (the default) rank 0 prints what each save and restore wrote or read, and how long it took.
    With a `key` (str or bytes, >= 16 bytes; else the environment's FZ_CKPT_KEY) saves are
    signed with it and restores refuse a checkpoint it did not sign (fz/ckpt/signing.py).
    """

    def __init__(self, root: PathLike, keep_last: int | None = None, async_: bool = False, verbose: bool = True,
                 key: signing.Key = None):
        _check_keep_last(keep_last, "Checkpointer")
        self.root, self.keep_last, self.async_, self.verbose = Path(root), keep_last, bool(async_), verbose
        self._key = signing.resolve(key)  # never printed: __repr__ leaves it out
        self._groups = GroupCache()
        self._pending: _Pending | None = None
        self._closed = False
        self._who = "Checkpointer."

    @classmethod
    def _for_functions(cls, root: PathLike, keep_last: int | None = None, async_: bool = False,
                       groups: GroupCache | None = None, key: signing.Key = None,
                       verbose: bool = True) -> Checkpointer:
        """One call of the function API: its messages say fz.save / fz.restore, and it shares
        one group with every other call (they never overlap: each first waits for all saves)."""
        _check_keep_last(keep_last, "fz.save")
        self = cls(root, None, async_, verbose, key=key)
        self.keep_last, self._who = keep_last, "fz."
        if groups is not None:
            self._groups = groups
        return self

    def __repr__(self) -> str:
        return f"Checkpointer({str(self.root)!r}, keep_last={self.keep_last}, async_={self.async_})"

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except BaseException as e:  # noqa: BLE001 - the block's own exception goes first
            _note(exc, f"also, a pending checkpoint of {self!r} failed: {type(e).__name__}: {e}")

    def _group(self, state: State):
        return self._groups.get(state_ranks(state), state.spec.timeout_s)

    def _arrive(self, state: State, what: str) -> None:
        """Every rank must call it: one rank alone fails fast instead of hanging (fz/distributed/arrival.py)."""
        peers.doing(f"{self._who}{what}", int(state.step))
        arrive(f"{self._who}{what}", state_ranks(state), state.plan.rank)

    def _check_open(self, what: str) -> None:
        raise_failed_saves()
        if self._closed:
            raise ConfigError(f"{self!r} is closed: {what} needs a new Checkpointer")

    def save(self, state: State, *, step: int | None = None, client_state: dict[str, Any] | None = None,
             client_state_per_rank: bool = False) -> None:
        """Write `state` (and `client_state`) as `root/step_<N>`, N = `step` or the state's step.

        `client_state` (a JSON-able dict, tensors allowed) must be the same on every rank (a
        ConfigError names the keys that differ), unless `client_state_per_rank=True` saves
        each rank's own. Waits for this Checkpointer's previous save first and raises its error.
        A step already saved is replaced; the old copy stays readable until the new one is committed.
        """
        self._save(state, step, client_state, client_state_per_rank)

    def _save(self, state: State, step: int | None, client_state: dict[str, Any] | None, client_state_per_rank: bool,
              target: Target | None = None) -> None:
        """`save`, into `target` (a DeepSpeed tag folder: fz/ckpt/functions.py) or `root/step_<N>`."""
        expect_state(state, f"{self._who}save")
        self._check_open("save")
        self.wait()
        self._arrive(state, "save")
        n = int(state.step) if step is None else step
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigError(f"{self._who}save step={step!r}: must be an integer >= 0")
        if client_state is not None and not isinstance(client_state, dict):
            raise ConfigError(f"{self._who}save client_state must be a dict, got {type(client_state).__name__}")
        t0, first = time.perf_counter(), self._reports(state)
        target = target or Target(self.root, step_name(n))
        with peers.translated():  # a peer lost in a save's collectives is a PeerError
            job = saver.prepare(state, target, n, client_state, self.keep_last, self._group(state),
                                stage=self.async_, client_per_rank=client_state_per_rank, key=self._key)
            if not self.async_:
                job.run()
        if not self.async_:
            self._report(first, "saved", target.final, t0)
            return
        staged = time.perf_counter() - t0
        # If dcp.async_save raised on some ranks only, the others' DCP threads would wait for
        # them until the group's timeout; it fails only on bad arguments, the same on every rank.
        pending = _Pending(job, lambda: self._report(first, "saved", target.final, t0,
                                                     f", training blocked {staged:.2f} s"))
        _install_exit_guards()
        with _lock:
            self._pending = pending
            _unwaited.add(self)

    def restore(self, state: State, *, step: int | None = None, strict: bool = True, with_client_state: bool = False,
                allow_nonfinite: bool = False) -> State | tuple[State, dict[str, Any]]:
        """Load the latest committed step (or `step`) into the template `state`, which is donated.

        Any world size, ZeRO stage or precision: the template says which. A damaged checkpoint
        or one of another model raises ConfigError; `strict=False` loads what both have and
        warns (PartialRestoreWarning). `with_client_state=True` returns (state, client_state).
        NaN or inf weights or moments: fz.NonFiniteError (allow_nonfinite=True: a warning).
        """
        return self._restore(state, step, strict, with_client_state, stacklevel=4, allow_nonfinite=allow_nonfinite)

    def _restore(self, state: State, step: int | None, strict: bool, with_client_state: bool, stacklevel: int,
                 allow_nonfinite: bool = False):
        expect_state(state, f"{self._who}restore")
        self._check_open("restore")
        self.wait()
        self._arrive(state, "restore")
        t0, first = time.perf_counter(), self._reports(state)
        with peers.translated():
            out = loader.load(state, self.root, self._group(state), step=step, strict=strict,
                              with_client_state=with_client_state, who=f"{self._who}restore", stacklevel=stacklevel,
                              key=self._key, allow_nonfinite=allow_nonfinite)
        where = resolve(self.root, step)
        note = _world_note(where, state) if state.plan.rank == min(state.plan.ranks) else ""
        if note and not first:  # verbose=False silences the restore line, not this
            logger("ckpt").warning(f"fz: restored {where}{note.replace(';', ':', 1)}")
        self._report(first, "restored", where, t0, note)
        return out

    def _reports(self, state: State) -> bool:
        return self.verbose and state.plan.rank == min(state.plan.ranks)

    @staticmethod
    def _report(first: bool, verb: str, path: Path, t0: float, note: str = "") -> None:
        """Rank 0: `fz: saved ckpt/step_100 (12.3 MB in 0.21 s)`, the bytes from the manifest."""
        if not first:
            return
        try:
            size = f"{sum(f['size'] for f in manifest.read(path).values()) / 2**20:.1f} MB"
        except ConfigError:
            size = "size unknown"
        logger("ckpt").info(f"fz: {verb} {path} ({size} in {time.perf_counter() - t0:.2f} s{note})")

    def wait(self) -> None:
        """Block until this Checkpointer's pending async save has committed; raise its error."""
        with _lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.join()
        finally:
            with _lock:
                if self._pending is None:
                    _unwaited.discard(self)

    def latest_step(self) -> int | None:
        """The step `latest` names, else the newest committed one, else None. Reads the
        directory only (no collective); a pending async save counts once committed."""
        name = read_latest(self.root)
        if name is not None:
            return int(name[len("step_"):])
        steps = committed_steps(self.root)
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Committed steps under the root, ascending (no collective)."""
        return committed_steps(self.root)

    def close(self) -> None:
        """Wait for the pending save (raising its error); later saves and restores are refused."""
        self._closed = True
        self.wait()


def wait_for_checkpoints() -> None:
    """Block until every Checkpointer's pending async save (fz.save's too) has committed;
    raise the first error, after waiting for all of them."""
    with _lock:
        waiting = list(_unwaited)
    first: BaseException | None = None
    for ckpt in waiting:
        try:
            ckpt.wait()
        except BaseException as e:  # noqa: BLE001 - raised once all have finished
            if first is None:
                first = e
            else:
                _note(first, f"another checkpoint failed too: {type(e).__name__}: {e}")
    if first is not None:
        raise first


def raise_failed_saves() -> None:
    """Raise the error of an async save that has already failed in the background (each once),
    naming the checkpoint: fz's entry points call this, so it surfaces at the next fz call."""
    with _lock:
        failed = [c for c in _unwaited if c._pending is not None and c._pending.failed]
    if failed:
        where = failed[0]._pending.where  # type: ignore[union-attr]  # not None: filtered above
        try:
            failed[0].wait()
        except BaseException as e:  # noqa: BLE001 - re-raised naming the checkpoint
            raise CheckpointError(f"the async save of checkpoint {where} failed in the background: "
                              f"{type(e).__name__}: {e}") from e


on_next_call(raise_failed_saves)


def _wait_at_exit() -> None:
    """At interpreter exit: wait for the pending saves; each failed one is reported with its
    checkpoint and cause, and the process exits with status 1 (an exit handler cannot change
    the status otherwise: logging and the standard streams are flushed first, and the exit
    handlers registered before fz was imported are skipped)."""
    with _lock:
        waiting = [(c, c._pending.where) for c in _unwaited if c._pending is not None]
    failed = 0
    for ckpt, where in waiting:
        try:
            ckpt.wait()
        except BaseException as e:  # noqa: BLE001 - nobody is left to catch it
            failed += 1
            print(f"fz: error: the async save of checkpoint {where} failed: {type(e).__name__}: {e}", file=sys.stderr)
    if failed:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(1)


_guards_installed = False


def _install_exit_guards() -> None:
    """At the first async save, not at import: interpreter exit waits for pending saves, and
    destroying the default group lets them commit first (fz/distributed/guards.py)."""
    global _guards_installed
    with _lock:
        if _guards_installed:
            return
        _guards_installed = True
    atexit.register(_wait_at_exit)
    guards.before_destroy(wait_for_checkpoints, order=0)


def _world_note(where: Path, state: State) -> str:
    """Restoring at another world size changes the global batch unless the rows per rank or the
    accumulation changed with it: said in the restore line, with the grad_accum that keeps it."""
    try:
        meta = read_json(where / META)
        saved, was = meta["world"], [meta.get("micro_batch"), meta.get("grad_accum")]  # absent before this fz
    except (ConfigError, KeyError, TypeError, ValueError, OSError, AttributeError):
        return ""

    def count(v: object) -> bool:  # a file's number, checked before it is used (a note, never a failure)
        return isinstance(v, int) and not isinstance(v, bool) and 0 < v < 2**40

    now, accum, micro = len(state.plan.ranks), state.spec.grad_accum, state.spec.micro_batch
    if not count(saved) or saved == now:
        return ""
    if all(count(v) for v in was) and micro is not None:
        before, after = was[0] * was[1] * saved, micro * accum * now
        if before == after:
            return ""
        keep, rows = before / (micro * now), f"{micro} rows per rank"
    else:  # the rows per rank unknown: taken as the same
        before, after, keep, rows = saved, now, accum * saved / now, "the same rows per rank"
    fix = (f"Spec(grad_accum={int(keep)}) keeps it" if keep == int(keep) and keep >= 1
           else f"no whole grad_accum keeps it with {rows}: change the rows per rank")
    return (f"; saved at world {saved}, restored at world {now}: with {rows} the global batch is "
            f"{after / before:g}x what it was ({fix})")