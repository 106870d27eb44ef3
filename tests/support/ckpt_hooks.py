"""Test-only crash and delay points for checkpoint saves, by wrapping the functions at each
phase boundary of a save (in the process that saves; production code has no hooks).

    arm("renamed", "kill")          # SIGKILL right after step_<N>.tmp is renamed to step_<N>
    arm("write_begin", "sleep=0.5") # hold every DCP write (sync or async) back 0.5 s
    hold = Hold(); arm("write_begin", hold); ...; hold.release()  # held until the test lets it go
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

_STEP_TMP = re.compile(r"^step_\d+\.tmp$")


def _name(p) -> str:
    return Path(os.fspath(p)).name


def _is_commit(src, dst) -> bool:
    return bool(_STEP_TMP.match(_name(src)))


def _is_latest(src, dst) -> bool:
    return _name(src) == "latest.tmp"


def _is_prune(src, dst) -> bool:  # pruning, or dropping the copy a replacing save set aside
    return _name(dst).endswith(".del") and not _name(src).endswith(".tmp")


def _is_set_aside(src, dst) -> bool:  # a save of a committed step moves the old copy aside
    return _name(dst).endswith(".old")


# point: (functions to wrap as (module, attribute), "before"/"after", which calls)
_DCP_SAVE = [("torch.distributed.checkpoint", "save"), ("torch.distributed.checkpoint.state_dict_saver", "save")]
POINTS: dict[str, tuple[list[tuple[str, str]], str, Callable[..., bool]]] = {
    "start": ([("fz.ckpt.layout", "clean_stale")], "before", None),  # phase 1, nothing written yet
    "write_begin": (_DCP_SAVE, "before", None),  # sync: dcp.save; async: what dcp.async_save's thread calls
    "written": (_DCP_SAVE, "after", None),
    "checksummed": ([("fz.ckpt.manifest", "write")], "before", None),
    "set_aside": ([("os", "replace")], "after", _is_set_aside),  # only when the step is already committed
    "before_rename": ([("os", "replace")], "before", _is_commit),
    "renamed": ([("os", "replace")], "after", _is_commit),
    "latest_tmp_written": ([("os", "replace")], "before", _is_latest),
    "latest_updated": ([("os", "replace")], "after", _is_latest),
    "pruning": ([("os", "replace")], "after", _is_prune),
    "done": ([("fz.ckpt.layout", "prune")], "after", None),
}


class Hold:
    """An action that holds what it is armed at until `release()`: a save that returned while its
    write was held did not wait for the write, however slow the machine. If nothing releases it
    (the save waited for its own write), it goes on after `limit_s` and `held_out` says so."""

    def __init__(self, limit_s: float = 60.0) -> None:
        self.limit_s, self.held_out = limit_s, False
        self._go = threading.Event()

    def __call__(self) -> None:
        if not self._go.wait(self.limit_s):
            self.held_out = True

    def release(self) -> None:
        self._go.set()


def _act(action: str | Callable[[], None]) -> None:
    if callable(action):
        action()
    elif action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action.startswith("sleep="):
        time.sleep(float(action[len("sleep="):]))
    else:
        raise ValueError(f"unknown action {action!r}")


def arm(point: str, action: str | Callable[[], None]) -> Callable[[], None]:
    """Do `action` ("kill", "sleep=S" or a function such as a Hold) at `point`; returns a function
    that disarms it."""
    import importlib

    targets, when, match = POINTS[point]
    undo = []
    for mod_name, attr in targets:
        mod = importlib.import_module(mod_name)
        orig = getattr(mod, attr)

        def wrapped(*args, __orig=orig, **kwargs):
            hit = match is None or match(*args[:2])
            if hit and when == "before":
                _act(action)
            out = __orig(*args, **kwargs)
            if hit and when == "after":
                _act(action)
            return out

        setattr(mod, attr, wrapped)
        undo.append((mod, attr, orig))

    def disarm() -> None:
        for mod, attr, orig in reversed(undo):
            setattr(mod, attr, orig)

    return disarm
