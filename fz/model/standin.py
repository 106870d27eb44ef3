"""Stand-ins for blocks: what the model sees where fz took a block out (fz/model/skeleton.py).

A `_UnitCall` stands where a block was. Calling it asks the running step (`running`) for
the block's parameters and runs the block; everything else a parent does with a block
(read `layer.layer_idx`, iterate, index, `len`, `isinstance`, `named_children()`, hooks) reads
the block itself. Only what fz holds apart, the block's own tensors and calls of its parts,
is refused, with a ConfigError that names the block and says what to do. A leaf of the root
taken out as a unit (fz/model/leaves.py) is the exception: its tensors were the root's, which
the model may use directly (`F.linear(h, self.wte.weight)`), so a read gets them from the
running step.
"""
from __future__ import annotations

import contextvars
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any, cast

import torch.nn as nn

from fz.errors import ConfigError

_RUNNER: contextvars.ContextVar[Any] = contextvars.ContextVar("fz_runner", default=None)


def _limit(what: str, unit: str) -> ConfigError:
    return ConfigError(
        f"the model {what} of block {unit!r} outside the block's own forward. fz holds a block's parameters "
        "apart and hands them over only while the block runs (stage 3 gathers them then): read or call it "
        f"inside {unit!r}'s forward, or choose the blocks with Spec(wrap=...) so that the module doing this "
        "is a block itself or contains the block (e.g. wrap=lambda name, m: name.count('.') == 2)")


def _read(inner: nn.Module, name: str, where: str, unit: str) -> Any:
    """An attribute of a block read from outside it: plain values as they are, tensors of its own
    (which fz holds) a ConfigError, modules a read-only `_Peek`."""
    if name.startswith("__"):
        raise AttributeError(name)
    for kind in ("_parameters", "_buffers"):  # a slot registered as None (Linear's bias=False) holds nothing of fz's
        if inner.__dict__.get(kind, {}).get(name) is not None:
            raise _limit(f"reads {kind[1:-1].rstrip('s')} {f'{where}.{name}'!r}", unit)
    value = getattr(inner, name)
    return _Peek(value, f"{where}.{name}", unit) if isinstance(value, nn.Module) else value


class _Reads:
    """Iteration, indexing and `len` of a block or container, as the module itself has them."""

    def _target(self) -> nn.Module:
        raise NotImplementedError

    def _where(self) -> str:
        raise NotImplementedError

    def _unit(self) -> str:
        raise NotImplementedError

    def _wrap(self, key: Any, value: Any) -> Any:
        return _Peek(value, f"{self._where()}.{key}", self._unit()) if isinstance(value, nn.Module) else value

    def __iter__(self) -> Iterator[Any]:
        target = self._target()
        if isinstance(target, nn.ModuleDict):
            return iter(target)  # keys, as ModuleDict does
        if not hasattr(type(target), "__iter__"):
            raise TypeError(f"{type(target).__name__} {self._where()!r} is not iterable")
        return iter([self._wrap(i, m) for i, m in enumerate(cast(Iterable[Any], target))])  # has __iter__

    def __len__(self) -> int:
        return len(self._target())  # type: ignore[arg-type]

    def __bool__(self) -> bool:
        return True

    def __getitem__(self, key: Any) -> Any:
        return self._wrap(key, self._target()[key])  # type: ignore[index]

    def __contains__(self, key: Any) -> bool:
        return key in self._target()  # type: ignore[operator]


class _Peek(_Reads):
    """A module inside a block, seen from outside it: readable, not callable (its parameters are fz's)."""

    def __init__(self, module: nn.Module, where: str, unit: str):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_name", where)
        object.__setattr__(self, "_unit_name", unit)

    def _target(self) -> nn.Module:
        return self._module

    def _where(self) -> str:
        return self._name

    def _unit(self) -> str:
        return self._unit_name

    def __getattr__(self, name: str) -> Any:
        return _read(self._module, name, self._name, self._unit_name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise _limit(f"calls {type(self._module).__name__} {self._name!r}, a part", self._unit_name)

    def __repr__(self) -> str:
        return f"fz view of {self._name!r}: {self._module!r}"


class _UnitCall(_Reads, nn.Module):
    """Stands where a unit was: calls go to the running step, which owns the parameters; plain
    attributes, iteration, indexing and `len` read the block itself. `readable`: a root leaf,
    whose own parameters and buffers the running step hands to a read (outside a step: the
    meta tensors, as the root's were)."""

    def __init__(self, index: int, inner: nn.Module, name: str, readable: bool = False):
        nn.Module.__init__(self)
        self._index = index
        object.__setattr__(self, "_inner", inner)  # not registered: its params are not the root's
        object.__setattr__(self, "_unit_name", name)
        object.__setattr__(self, "_readable", readable)

    def _target(self) -> nn.Module:
        return self._inner

    def _where(self) -> str:
        return self._unit_name

    def _unit(self) -> str:
        return self._unit_name

    def __getattr__(self, name: str) -> Any:
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            if "_inner" not in self.__dict__:
                raise
        unit, inner = self.__dict__["_unit_name"], self.__dict__["_inner"]
        if self.__dict__["_readable"] and (inner._parameters.get(name) is not None
                                           or inner._buffers.get(name) is not None):
            runner = _RUNNER.get()
            return getattr(inner, name) if runner is None else runner.read(self._index, name)
        return _read(inner, name, unit, unit)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        runner = _RUNNER.get()
        if runner is None:
            raise RuntimeError("fz skeleton called outside fz.train_step/eval_step/apply")
        return runner.call_unit(self._index, args, kwargs)

    # A library that walks the model (Hugging Face's output recorders, installed on the first
    # forward) finds the block where it was: the stand-in passes for the block's class, and its
    # children are the block's, whose hooks run inside the block's call; a hook on the stand-in
    # runs around the unit's call, with the block's arguments and output.
    @property  # type: ignore[misc]  # isinstance(stand_in, BlockClass) reads __class__
    def __class__(self) -> type:
        inner = self.__dict__.get("_inner")
        return _UnitCall if inner is None else type(inner)

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        return self.__dict__["_inner"].named_children()

    def extra_repr(self) -> str:
        return f"fz block {self._unit_name!r}: {type(self._inner).__name__}"


def running(runner: Any) -> AbstractContextManager[Any]:
    """Context: unit calls go to `runner.call_unit(index, args, kwargs)`."""
    token = _RUNNER.set(runner)

    class _Ctx:
        def __enter__(self) -> Any:
            return runner

        def __exit__(self, *exc: object) -> None:
            _RUNNER.reset(token)

    return _Ctx()
