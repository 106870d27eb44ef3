"""The model as fz runs it: a meta-device copy, cut into units that are called functionally.

fz never mutates or wraps the user's module. It deep-copies it with every parameter and
buffer replaced by a meta tensor, then puts a `_UnitCall` in place of each unit (by
default each child of a ModuleList/Sequential: the transformer blocks). A unit's call
asks the running step for that unit's parameters (gathered, for stage 3) and runs the
original block with `torch.func.functional_call`. What is not in a unit is the root.
"""
from __future__ import annotations

import contextvars
import copy
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from fz.errors import ConfigError

WrapPolicy = Callable[[str, nn.Module], bool]


def default_wrap(name: str, module: nn.Module, parent: Optional[nn.Module]) -> bool:
    """A unit is an element of a ModuleList/Sequential that holds parameters."""
    return isinstance(parent, (nn.ModuleList, nn.Sequential)) and any(True for _ in module.parameters())


@dataclass(frozen=True)
class Unit:
    name: str  # "" for the root
    module: nn.Module  # meta skeleton of the block (the root skeleton for unit 0)
    params: Tuple[Tuple[str, str], ...]  # (name inside the unit, canonical parameter name)
    buffers: Tuple[Tuple[str, str], ...]  # (name inside the unit, canonical buffer name)


_RUNNER: contextvars.ContextVar[Any] = contextvars.ContextVar("fz_runner", default=None)


class _UnitCall(nn.Module):
    """Stands where a unit was; forwards to the running step, which owns the parameters."""

    def __init__(self, index: int, inner: nn.Module):
        super().__init__()
        self._index = index
        object.__setattr__(self, "_inner", inner)  # not registered: its params are not the root's

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        runner = _RUNNER.get()
        if runner is None:
            raise RuntimeError("fz skeleton called outside fz.train_step/eval_step/apply")
        return runner.call_unit(self._index, args, kwargs)


def running(runner: Any):
    """Context: unit calls go to `runner.call_unit(index, args, kwargs)`."""
    token = _RUNNER.set(runner)

    class _Ctx:
        def __enter__(self):
            return runner

        def __exit__(self, *exc):
            _RUNNER.reset(token)

    return _Ctx()


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy whose parameters and buffers are meta tensors (ties kept, no data copied)."""
    memo: Dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


@dataclass(frozen=True)
class Skeleton:
    root: nn.Module
    units: Tuple[Unit, ...]  # units[0] is the root
    param_unit: Dict[str, int]  # canonical param name -> the unit that owns it
    aliases: Dict[str, str]  # every parameter/buffer name (tied included) -> canonical name

    @property
    def signature(self) -> tuple:
        """What the skeleton is, by value: its units' names, classes, parameter and buffer names."""
        return tuple((u.name, type(u.module).__qualname__, u.params, u.buffers) for u in self.units)


def build_skeleton(model: nn.Module, wrap: Optional[WrapPolicy] = None) -> Skeleton:
    root = meta_copy(model)
    canon: Dict[int, str] = {}
    aliases: Dict[str, str] = {}
    for name, t in list(root.named_parameters(remove_duplicate=False)) + list(root.named_buffers(remove_duplicate=False)):
        aliases[name] = canon.setdefault(id(t), name)

    chosen: List[str] = []
    for name, module in root.named_modules():
        if not name or any(name.startswith(c + ".") for c in chosen):
            continue
        parent = root.get_submodule(name.rsplit(".", 1)[0]) if "." in name else root
        if (wrap(name, module) if wrap else default_wrap(name, module, parent)):
            chosen.append(name)

    # A parameter used by more than one unit (or by a unit and the root) belongs to the root.
    users: Dict[str, set] = {}
    for full, _ in root.named_parameters(remove_duplicate=False):
        owner = next((i for i, u in enumerate(chosen, start=1) if full.startswith(u + ".")), 0)
        users.setdefault(aliases[full], set()).add(owner)
    param_unit = {c: (min(u) if len(u) == 1 else 0) for c, u in users.items()}

    units: List[Unit] = []
    for i, uname in enumerate(chosen, start=1):
        inner = root.get_submodule(uname)
        params = tuple((local, aliases[f"{uname}.{local}"]) for local, _ in inner.named_parameters(remove_duplicate=False))
        buffers = tuple((local, aliases[f"{uname}.{local}"]) for local, _ in inner.named_buffers(remove_duplicate=False))
        units.append(Unit(uname, inner, params, buffers))
    for i, unit in enumerate(units, start=1):
        parent_name, _, leaf = unit.name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        setattr(parent, leaf, _UnitCall(i, unit.module))
    root_params = tuple((n, aliases[n]) for n, _ in root.named_parameters(remove_duplicate=False))
    root_buffers = tuple((n, aliases[n]) for n, _ in root.named_buffers(remove_duplicate=False))
    if not param_unit:
        raise ConfigError("the model has no parameters: there is nothing to train")
    return Skeleton(root, (Unit("", root, root_params, root_buffers), *units), param_unit, aliases)


def bucket_entries(model: nn.Module, skel: Skeleton) -> List[Tuple[str, torch.Size, int, bool]]:
    """(name, shape, unit, trainable) of every parameter in bucket order (by unit, then the
    model's order): what `make_buckets` groups. fz.init and fz.estimate share it."""
    named = list(model.named_parameters(remove_duplicate=True))
    order = sorted(range(len(named)), key=lambda i: skel.param_unit[named[i][0]])
    return [(named[i][0], named[i][1].shape, skel.param_unit[named[i][0]], named[i][1].requires_grad) for i in order]
