"""Forward hooks a library adds to `trainer.model` after fz made the State, run by fz's copy too.

fz trains a copy of the model made when the State is (fz/model/skeleton.py): hooks on the user's
modules at that moment are in it, but one added later (transformers' NEFTune puts a forward hook
on the input embeddings as train() starts) would never run. When training starts (and after
each generation of an online trainer), each such hook (and the plain settings it reads on its
module, as `neftune_noise_alpha`) is put on the copy's module of the same name as well, and taken
off again after; fz's own hooks stay the user's. Before each step `follow` mirrors them anew if
the model's hooks changed since (one a callback adds in on_train_begin or on_step_begin, or takes
off): a pass over the model's modules' hook tables, no copy.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from fz.model.skeleton import Skeleton

_PLAIN = (bool, int, float, str, type(None))


def flag(value: Any) -> bool:
    """A setting a library keeps on a module: a plain value, or a collection of names."""
    if isinstance(value, _PLAIN):
        return True
    return isinstance(value, (tuple, list, set, frozenset)) and all(isinstance(v, str) for v in value)


def skeleton_modules(skel: Skeleton) -> dict[str, nn.Module]:
    """Every module of the skeleton by the model's name for it (a block's insides included:
    the root holds a stand-in where each block was)."""
    units = {u.name: u.module for u in skel.units[1:]}
    out: dict[str, nn.Module] = {}
    for name, module in skel.root.named_modules():
        if name in units:
            for inner, m in units[name].named_modules():
                out[f"{name}.{inner}" if inner else name] = m
        elif not any(name.startswith(u + ".") for u in units):
            out[name] = module
    return out


_TABLES = ("_forward_hooks", "_forward_pre_hooks")
_FLAGS = ("_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs")
_UNDO: weakref.WeakKeyDictionary[nn.Module, Callable[[], None]] = weakref.WeakKeyDictionary()
_SEEN: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()  # the model's hooks when mirrored


def _hooks(model: nn.Module) -> tuple:
    """Every forward hook on `model`'s modules, as (handle id, the hook's id): it differs once one
    is added, taken off or replaced (a handle id is never given twice)."""
    return tuple((k, id(h)) for m in model.modules() for t in (m._forward_hooks, m._forward_pre_hooks)
                 for k, h in t.items())


def follow(model: nn.Module, skel: Skeleton) -> None:
    """`mirror` again where `model`'s hooks changed since it last ran (while it is mirrored)."""
    if model in _SEEN and _SEEN[model] != _hooks(model):
        mirror(model, skel)


def _ours(hook: Any) -> bool:
    module = getattr(hook, "__module__", None) or type(hook).__module__
    return str(module).startswith("fz.")


def mirror(model: nn.Module, skel: Skeleton) -> None:
    """`model`'s hooks added since `skel` was made, and the settings they read, on `skel` too."""
    unmirror(model)
    theirs = dict(model.named_modules())
    added: list[tuple[nn.Module, str, Any]] = []  # (module, table or attribute, key)
    for name, mine in skeleton_modules(skel).items():
        other = theirs.get(name)
        if other is None:
            continue
        new = False
        for table in _TABLES:
            own, given = getattr(mine, table), getattr(other, table)
            for key, hook in given.items():
                if key not in own and not _ours(hook):
                    own[key] = hook
                    added.append((mine, table, key))
                    new = True
                    for flags in _FLAGS:
                        if key in getattr(other, flags, {}):
                            getattr(mine, flags)[key] = getattr(other, flags)[key]
                            added.append((mine, flags, key))
        if new:
            for key, value in vars(other).items():
                if key not in mine.__dict__ and not key.startswith("_") and flag(value):
                    mine.__dict__[key] = value
                    added.append((mine, "", key))

    def undo() -> None:
        for module, table, key in reversed(added):
            (getattr(module, table) if table else module.__dict__).pop(key, None)

    _UNDO[model] = undo
    _SEEN[model] = _hooks(model)


def unmirror(model: nn.Module) -> None:
    """What `mirror` put on the copy taken off."""
    _SEEN.pop(model, None)
    undo = _UNDO.pop(model, None)
    if undo is not None:
        undo()
