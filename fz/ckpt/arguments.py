"""The function API's argument order: `fz.save(state, path)` and `fz.restore(state, path)`.

The state comes first in both, as in `fz.load_weights(state, path)`, `Checkpointer.restore(state)`
and `fz.train_step(state, batch)`: it is what the call works on, and restore's state is the
template it returns a filled copy of. (orbax puts the directory first; fz's functions take the
state first throughout.) fz 0.1's `fz.restore(path, state)` still works, with a DeprecationWarning,
told apart by the arguments' types; any other pair is a ConfigError naming the signature.
"""
from __future__ import annotations

import os
import warnings
from typing import Any

from fz.ckpt.layout import PathLike
from fz.errors import ConfigError
from fz.state import State, expect_state


def _is_path(x: Any) -> bool:
    return isinstance(x, (str, os.PathLike))


def state_and_path(who: str, state: Any, path: Any, *, old_order: bool = False) -> tuple[State, PathLike]:
    """(state, path) of a call `who(state, path)`; with `old_order`, `who(path, state)` is
    accepted and warns (stacklevel: the caller of `who`)."""
    if isinstance(state, State) and _is_path(path):
        return state, path
    if old_order and _is_path(state) and isinstance(path, State):
        warnings.warn(f"{who}(path, state) is deprecated: call {who}(state, path), the state first as in "
                      f"fz.save and fz.load_weights", DeprecationWarning, stacklevel=3)
        return path, state
    if _is_path(path) and not isinstance(state, State) and not _is_path(state):
        expect_state(state, who)  # raises, naming what was given (a model, a Spec, ...)
    if old_order and _is_path(state) and not isinstance(path, State) and not _is_path(path):
        expect_state(path, who)
    swapped = " (the state comes first)" if _is_path(state) and isinstance(path, State) else ""
    raise ConfigError(f"{who}(state, path) needs an fz.State and a checkpoint path (str or os.PathLike), "
                      f"got ({type(state).__name__}, {type(path).__name__}){swapped}")
