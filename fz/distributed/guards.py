"""What must happen before the default process group goes away, installed only when needed.

Importing fz patches nothing. The first time something needs it (the heartbeat starts, an
async save starts), `before_destroy(hook)` wraps `torch.distributed.destroy_process_group`
once: destroying the default group then first runs the hooks (pending async saves commit,
the heartbeat stops talking to the group's store), then destroys, and raises the first hook's
error after. Without that, a save's last phase or a heartbeat store call would be cut off
mid-way ("terminate called without an active exception", a step_<N>.tmp left behind).
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

_lock = threading.Lock()
_hooks: list[tuple[int, Callable[[], None]]] = []  # (order, hook): lower order runs first


def before_destroy(hook: Callable[[], None], order: int = 0) -> None:
    """Run `hook` before the default group is destroyed (once per hook; installs the wrapper)."""
    with _lock:
        if all(h is not hook for _, h in _hooks):
            _hooks.append((order, hook))
            _hooks.sort(key=lambda oh: oh[0])
        for module in (dist, dist.distributed_c10d):
            patched: Any = module  # a module attribute replaced: no static type says it may be
            if not getattr(patched.destroy_process_group, "_fz_guarded", False):
                patched.destroy_process_group = _guarded(patched.destroy_process_group)


def _guarded(destroy: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(destroy)
    def wrapper(group: Any = None, *args: Any, **kwargs: Any) -> Any:
        err: BaseException | None = None
        if group is None or group is dist.GroupMember.WORLD:
            with _lock:
                hooks = [h for _, h in _hooks]
            for hook in hooks:
                try:
                    hook()
                except BaseException as e:  # noqa: BLE001 - raised after the group is destroyed, as asked
                    err = err or e
        out = destroy(group, *args, **kwargs)
        if err is not None:
            raise err
        return out
    wrapper.__dict__["_fz_guarded"] = True
    return wrapper
