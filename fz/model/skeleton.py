"""The model as fz runs it: a meta-device copy, cut into units that are called functionally.

fz never mutates or wraps the user's module. It deep-copies it with every parameter and
buffer replaced by a meta tensor, then puts a stand-in (fz/model/standin.py) in place of
each unit (by default each block with parameters in a ModuleList/Sequential, containers
of blocks looked into: the transformer blocks). A unit's call asks the running step for
that unit's parameters (gathered, for stage 3) and runs the original block with
`torch.func.functional_call`. What is not in a unit is the root.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _NormBase

from fz.errors import ConfigError
from fz.model.standin import _UnitCall

WrapPolicy = Callable[[str, nn.Module], bool]


_CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # hold modules, have no forward of their own


def default_wrap(name: str, module: nn.Module, parents: Sequence[nn.Module]) -> bool:
    """A unit is a module with a forward and parameters whose parent is a ModuleList or
    Sequential, or a container inside one (`layers[i]` a ModuleList/ModuleDict of blocks):
    the parent then calls, iterates and unpacks the containers themselves, never a stand-in."""
    if isinstance(module, _CONTAINERS) or not any(True for _ in module.parameters()):
        return False
    for parent in reversed(parents):  # nearest first, through containers only
        if isinstance(parent, (nn.ModuleList, nn.Sequential)):
            return True
        if not isinstance(parent, nn.ModuleDict):
            return False
    return False


@dataclass(frozen=True)
class Unit:
    name: str  # "" for the root
    module: nn.Module  # meta skeleton of the block (the root skeleton for unit 0)
    params: Tuple[Tuple[str, str], ...]  # (name inside the unit, canonical parameter name)
    buffers: Tuple[Tuple[str, str], ...]  # (name inside the unit, canonical buffer name)
    checkpointed: bool = False  # Hugging Face's gradient checkpointing was on inside it (fz does it instead)


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
    persistent: Tuple[str, ...] = ()  # canonical buffers in the model's state_dict (exported with the weights)
    cast_buffers: Tuple[str, ...] = ()  # floating buffers of modules with parameters (given in the compute dtype)
    running_stats: Tuple[str, ...] = ()  # buffers that kernels update in train mode without a version bump (BatchNorm)

    @property
    def training(self) -> bool:
        """The mode the last `set_mode` put the modules in."""
        return bool(getattr(self.root, "_fz_mode", False))

    def set_mode(self, training: bool) -> None:
        """Put every module of the skeleton (the root and each unit's block) in train or eval mode."""
        if getattr(self.root, "_fz_mode", None) is not training:
            for unit in self.units:
                unit.module.train(training)
            object.__setattr__(self.root, "_fz_mode", training)

    @property
    def signature(self) -> tuple:
        """What the skeleton is, by value: its units' names, classes, parameter and buffer names."""
        return tuple((u.name, type(u.module).__qualname__, u.params, u.buffers) for u in self.units)


def _parents(root: nn.Module, name: str) -> List[nn.Module]:
    """The modules from the root down to `name`'s parent."""
    out, module = [root], root
    for part in name.split(".")[:-1]:
        module = module.get_submodule(part)
        out.append(module)
    return out


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
        if wrap(name, module) if wrap else default_wrap(name, module, _parents(root, name)):
            chosen.append(name)

    # A parameter used by more than one unit (or by a unit and the root) belongs to the root.
    users: Dict[str, set] = {}
    for full, _ in root.named_parameters(remove_duplicate=False):
        owner = next((i for i, u in enumerate(chosen, start=1) if full.startswith(u + ".")), 0)
        users.setdefault(aliases[full], set()).add(owner)
    param_unit = {c: (min(u) if len(u) == 1 else 0) for c, u in users.items()}

    persistent, cast, running = _buffer_kinds(root, aliases)
    units: List[Unit] = []
    for i, uname in enumerate(chosen, start=1):
        inner = root.get_submodule(uname)
        params = tuple((local, aliases[f"{uname}.{local}"]) for local, _ in inner.named_parameters(remove_duplicate=False))
        buffers = tuple((local, aliases[f"{uname}.{local}"]) for local, _ in inner.named_buffers(remove_duplicate=False))
        units.append(Unit(uname, inner, params, buffers, _take_hf_checkpointing(inner)))
    for i, unit in enumerate(units, start=1):
        parent_name, _, leaf = unit.name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        setattr(parent, leaf, _UnitCall(i, unit.module, unit.name))
    root_params = tuple((n, aliases[n]) for n, _ in root.named_parameters(remove_duplicate=False))
    root_buffers = tuple((n, aliases[n]) for n, _ in root.named_buffers(remove_duplicate=False))
    if not param_unit:
        raise ConfigError("the model has no parameters: there is nothing to train")
    return Skeleton(root, (Unit("", root, root_params, root_buffers), *units), param_unit, aliases, persistent, cast, running)


def bucket_entries(model: nn.Module, skel: Skeleton) -> List[Tuple[str, torch.Size, int, bool]]:
    """(name, shape, unit, trainable) of every parameter in bucket order (by unit, then the
    model's order): what `make_buckets` groups. fz.init and fz.estimate share it."""
    named = list(model.named_parameters(remove_duplicate=True))
    order = sorted(range(len(named)), key=lambda i: skel.param_unit[named[i][0]])
    return [(named[i][0], named[i][1].shape, skel.param_unit[named[i][0]], named[i][1].requires_grad) for i in order]


def _buffer_kinds(root: nn.Module, aliases: Dict[str, str]) -> Tuple[Tuple[str, ...], ...]:
    """(buffers in the state_dict, floating buffers whose module has floating parameters, running
    statistics of norm layers), canonical names.

    The second kind is a module's running statistics (BatchNorm's): its math mixes them with
    its weights, so in bf16/fp16 fz gives them in the compute dtype; a buffer of a module
    without parameters (a RoPE table) keeps its dtype, as under autocast."""
    persistent, cast, running = [], [], []
    for mname, module in root.named_modules(remove_duplicate=False):
        if isinstance(module, _NormBase) and module.track_running_stats:  # updated inside the kernel
            running += [aliases[f"{mname}.{leaf}" if mname else leaf] for leaf in ("running_mean", "running_var")
                        if module._buffers.get(leaf) is not None]
        has_float_params = any(p.is_floating_point() for p in module.parameters(recurse=False))
        for leaf, b in module._buffers.items():
            if b is None:
                continue
            name = aliases[f"{mname}.{leaf}" if mname else leaf]
            if leaf not in module._non_persistent_buffers_set and name not in persistent:
                persistent.append(name)
            if has_float_params and b.is_floating_point() and name not in cast:
                cast.append(name)
    return tuple(persistent), tuple(cast), tuple(dict.fromkeys(running))


def _take_hf_checkpointing(block: nn.Module) -> bool:
    """Hugging Face's gradient checkpointing inside a block (`gradient_checkpointing = True` on its
    layers) would recompute the block in backward with fz's meta tensors: it is turned off in fz's
    copy and fz checkpoints the whole block instead (the same recompute, its gather included)."""
    found = False
    for m in block.modules():
        if getattr(m, "gradient_checkpointing", False) is True:
            m.gradient_checkpointing = False
            found = True
    return found
