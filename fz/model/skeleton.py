"""The model as fz runs it: a meta-device copy, cut into units that are called functionally.

fz never mutates or wraps the user's module. It deep-copies it with every parameter and
buffer replaced by a meta tensor, then puts a stand-in (fz/model/standin.py) in place of
each unit (by default each block with parameters in a ModuleList/Sequential, containers
of blocks looked into: the transformer blocks). A unit's call asks the running step for
that unit's parameters (gathered, for stage 3) and runs the original block with
`torch.func.functional_call`. What is not in a unit is the root; at stage 3 with offloaded
parameters the root's leaves (embeddings, final norm, head) are units too (fz/model/leaves.py).
"""
from __future__ import annotations

import copy
import functools
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _NormBase

from fz.errors import ConfigError
from fz.model.leaves import occurrences, root_leaves
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
    params: tuple[tuple[str, str], ...]  # (name inside the unit, canonical parameter name)
    buffers: tuple[tuple[str, str], ...]  # (name inside the unit, canonical buffer name)
    checkpointed: bool = False  # Hugging Face's gradient checkpointing was on inside it (fz does it instead)
    leaf: bool = False  # a leaf of the root fetched per use (fz/model/leaves.py), not a block


SHARED = ("config", "generation_config")  # Hugging Face's: one object for the model and its copy
# the hook tables whose hooks the copy shares with the model (a hook object counting its calls, a bound method of
# the user's tracker: what they keep is the user's, not a copy's), and accelerate's hook attribute
_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_HOOK_ATTRS = ("_hf_hook",)


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy whose parameters and buffers are meta tensors (ties kept, no data copied). A
    module's Hugging Face `config` (and `generation_config`) is the model's own, not a copy: the
    forward writes into it (a classifier's `problem_type`), which the user's model saves."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        for name in SHARED:
            held = module.__dict__.get(name)
            if held is not None and not isinstance(held, (nn.Module, torch.Tensor)):
                memo[id(held)] = held
        for hook in [*(h for t in _HOOK_TABLES for h in getattr(module, t, {}).values()),
                     *(module.__dict__.get(a) for a in _HOOK_ATTRS)]:
            _share_hook(hook, memo)
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    root = copy.deepcopy(model, memo)
    for module in root.modules():
        _rebind_patched_forward(module, memo)
    return root


def _share_hook(hook: Any, memo: dict[int, Any]) -> None:
    """A hook object, or the object a bound-method hook is of, shared by the copy (the state it keeps is
    the user's); a module among them is left to deepcopy (its copy, with meta tensors), and so is an object
    that says how it is copied (`__deepcopy__`: fz.hf's PlaceFirst copies as a hook that does nothing); a
    function is shared anyway."""
    if hook is None or isinstance(hook, (types.FunctionType, functools.partial)):
        return
    held = hook.__self__ if isinstance(hook, types.MethodType) else hook
    if not isinstance(held, (nn.Module, torch.Tensor)) and not hasattr(type(held), "__deepcopy__") \
            and not _holds_modules(held):
        memo[id(held)] = held


def _holds_modules(obj: Any) -> bool:
    """Whether `obj`'s attributes reach a module or a tensor (one level into dicts, lists and tuples):
    such a hook (transformers' DebugUnderflowOverflow keys its names by module, accelerate's offload
    hooks hold the model) must be copied with the model, so that it finds the copy's modules."""
    def reaches(value: Any) -> bool:
        return isinstance(value, (nn.Module, torch.Tensor))

    for value in getattr(obj, "__dict__", {}).values():
        if reaches(value):
            return True
        if isinstance(value, dict) and any(reaches(k) or reaches(v) for k, v in value.items()):
            return True
        if isinstance(value, (list, tuple, set)) and any(reaches(v) for v in value):
            return True
    return False


def _rebind_patched_forward(module: nn.Module, memo: dict[int, Any]) -> None:
    """A forward a library put on the module calls, in the copy, the copy's forward. TRL's fused LM
    head sets `model.forward = MethodType(f, model)`, `f` calling the forward it found, held in its
    closure; accelerate's mixed precision then wraps that in autocast and an output cast (closures
    and a callable object). deepcopy rebinds the outer method but shares what it wraps, which would
    still call the original module (its own weights, let go or stale)."""
    patched = module.__dict__.get("forward")
    if isinstance(patched, types.MethodType):
        func = _rebound(patched.__func__, memo, 0)
        if func is not patched.__func__:
            module.__dict__["forward"] = types.MethodType(func, patched.__self__)
    elif patched is not None:
        module.__dict__["forward"] = _rebound(patched, memo, 0)


_WRAPS = 8  # wrappers deep: a forward patched, cast, autocast, ... is a handful


def _rebound(value: Any, memo: dict[int, Any], depth: int) -> Any:
    """`value` calling the copies (in `memo`) of the modules it calls a method of, however deep in
    closures and wrapper objects; `value` itself where it calls none."""
    if depth > _WRAPS:
        return value
    if isinstance(value, nn.Module):  # a module the closure calls itself (TRL's fp32 LM head: `lm_head.weight`)
        return memo.get(id(value), value)
    if isinstance(value, functools.partial):
        parts = [_rebound(v, memo, depth + 1) for v in (value.func, *value.args)]
        words = {k: _rebound(v, memo, depth + 1) for k, v in value.keywords.items()}
        if parts[0] is value.func and all(a is b for a, b in zip(parts[1:], value.args)) and \
                all(words[k] is v for k, v in value.keywords.items()):
            return value
        return functools.partial(parts[0], *parts[1:], **words)
    if isinstance(value, types.MethodType):
        owner = value.__self__
        if isinstance(owner, nn.Module) and id(owner) in memo:  # the original's method, as the copy's
            return types.MethodType(_rebound(value.__func__, memo, depth + 1), memo[id(owner)])
        return value
    if isinstance(value, types.FunctionType):
        if not value.__closure__:
            return value
        cells = []
        for cell in value.__closure__:
            try:
                inner = cell.cell_contents
            except ValueError:  # an empty cell
                cells.append(cell)
                continue
            other = _rebound(inner, memo, depth + 1)
            cells.append(cell if other is inner else types.CellType(other))
        if all(a is b for a, b in zip(cells, value.__closure__)):
            return value
        func = types.FunctionType(value.__code__, value.__globals__, value.__name__, value.__defaults__, tuple(cells))
        func.__kwdefaults__, func.__dict__ = value.__kwdefaults__, dict(value.__dict__)
        func.__qualname__, func.__doc__ = value.__qualname__, value.__doc__
        return func
    if callable(value) and hasattr(value, "__dict__") and not isinstance(value, (type, nn.Module, torch.Tensor)):
        changed = {k: o for k, v in vars(value).items() if (o := _rebound(v, memo, depth + 1)) is not v}
        if changed:  # a wrapper object (accelerate's output cast, which refuses to be copied): a new one
            try:
                clone = object.__new__(type(value))
            except TypeError:  # a C type's instance (not a wrapper Python code made)
                return value
            vars(clone).update({**vars(value), **changed})
            return clone
    return value


@dataclass(frozen=True)
class Skeleton:
    root: nn.Module
    units: tuple[Unit, ...]  # units[0] is the root
    param_unit: dict[str, int]  # canonical param name -> the unit that owns it
    aliases: dict[str, str]  # every parameter/buffer name (tied included) -> canonical name
    persistent: tuple[str, ...] = ()  # canonical buffers in the model's state_dict (exported with the weights)
    cast_buffers: tuple[str, ...] = ()  # floating buffers of modules with parameters (given in the compute dtype)
    running_stats: tuple[str, ...] = ()  # buffers that kernels update in train mode without a version bump (BatchNorm)
    fetches_root: bool = False  # the root's leaves were asked for as units (fz/model/leaves.py)
    shared: dict[str, tuple[int, ...]] = field(default_factory=dict)  # param -> the units gathering it (several)

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


def _parents(root: nn.Module, name: str) -> list[nn.Module]:
    """The modules from the root down to `name`'s parent."""
    out, module = [root], root
    for part in name.split(".")[:-1]:
        module = module.get_submodule(part)
        out.append(module)
    return out


def build_skeleton(model: nn.Module, wrap: WrapPolicy | None = None, fetch_root: bool = False) -> Skeleton:
    """The meta skeleton of `model` cut into units; `fetch_root`: the root's leaves are units
    too (stage 3 with offloaded parameters: fz/model/leaves.py)."""
    root = meta_copy(model)
    canon: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, t in list(root.named_parameters(remove_duplicate=False)) + list(
        root.named_buffers(remove_duplicate=False)
    ):
        aliases[name] = canon.setdefault(id(t), name)

    blocks: list[str] = []
    for name, module in root.named_modules():
        if not name or any(name.startswith(c + ".") for c in blocks):
            continue
        if wrap(name, module) if wrap else default_wrap(name, module, _parents(root, name)):
            blocks.append(name)
    leaves = root_leaves(root, blocks) if fetch_root else []
    order = {name: i for i, (name, _) in enumerate(root.named_modules())}
    chosen = sorted(blocks + leaves, key=order.__getitem__)  # the model's order: call order, mostly
    users = _users(root, chosen, aliases)
    # a leaf all of whose parameters stay with the root (tied to the root's own) gathers nothing
    chosen = [c for c in chosen if c in blocks or any(
        _owner(users[aliases[f"{c}.{local}"]], fetch_root) for local, _ in root.get_submodule(c).named_parameters())]
    users = _users(root, chosen, aliases)
    param_unit = {c: _owner(u, fetch_root) for c, u in users.items()}
    shared = {c: tuple(sorted(u)) for c, u in users.items() if len(u) > 1 and param_unit[c]}

    persistent, cast, running = _buffer_kinds(root, aliases)
    units: list[Unit] = []
    for uname in chosen:
        inner = root.get_submodule(uname)
        params = tuple(
            (local, aliases[f"{uname}.{local}"]) for local, _ in inner.named_parameters(remove_duplicate=False)
        )
        buffers = tuple(
            (local, aliases[f"{uname}.{local}"]) for local, _ in inner.named_buffers(remove_duplicate=False)
        )
        units.append(Unit(uname, inner, params, buffers, _take_hf_checkpointing(inner), uname in leaves))
    places = occurrences(root, chosen)
    for i, unit in enumerate(units, start=1):
        stand_in = _UnitCall(i, unit.module, unit.name, readable=unit.leaf)
        for place in places[unit.name]:
            parent_name, _, leaf = place.rpartition(".")
            setattr(root.get_submodule(parent_name) if parent_name else root, leaf, stand_in)
    root_params = tuple((n, aliases[n]) for n, _ in root.named_parameters(remove_duplicate=False))
    root_buffers = tuple((n, aliases[n]) for n, _ in root.named_buffers(remove_duplicate=False))
    if not param_unit:
        raise ConfigError("the model has no parameters: there is nothing to train")
    return Skeleton(root, (Unit("", root, root_params, root_buffers), *units), param_unit, aliases, persistent, cast,
                    running, fetch_root, shared)


def _users(root: nn.Module, units: Sequence[str], aliases: dict[str, str]) -> dict[str, set]:
    """Canonical parameter -> the units whose module holds it (0: the root holds it outside them)."""
    inside: dict[str, int] = {}
    for i, (unit, places) in enumerate(occurrences(root, units).items(), start=1):
        for local, _ in root.get_submodule(unit).named_parameters(remove_duplicate=False):
            inside.update((f"{place}.{local}", i) for place in places)
    users: dict[str, set] = {}
    for full, _ in root.named_parameters(remove_duplicate=False):
        users.setdefault(aliases[full], set()).add(inside.get(full, 0))
    return users


def _owner(users: set, fetch_root: bool) -> int:
    """The unit whose buckets hold a parameter. One used by several units belongs to the root
    (gathered once a step), or, when the root's leaves are fetched per use (a tied embedding
    and head), to the first of them; each user then gathers that bucket (fz/step/runner.py)."""
    if len(users) == 1:
        return next(iter(users))
    return 0 if 0 in users or not fetch_root else min(users)


def bucket_entries(model: nn.Module, skel: Skeleton) -> list[tuple[str, torch.Size, int, bool]]:
    """(name, shape, unit, trainable) of every parameter in bucket order (by unit, then the
    model's order): what `make_buckets` groups. fz.init and fz.estimate share it. The root's
    leaves keep the root's place (first, in the model's order), so states list their parameters
    (`state.params`, `fz.full_params`) in the same order whether the leaves are units or not."""
    named = list(model.named_parameters(remove_duplicate=True))
    units = [skel.param_unit[n] for n, _ in named]
    order = sorted(range(len(named)), key=lambda i: 0 if skel.units[units[i]].leaf else units[i])
    return [(named[i][0], named[i][1].shape, units[i], named[i][1].requires_grad) for i in order]


def _buffer_kinds(root: nn.Module, aliases: dict[str, str]) -> tuple[tuple[str, ...], ...]:
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


def _direct(fn: Any, *args: Any) -> Any:
    return fn(*args)


def hf_layers_as_checkpointed(block: nn.Module) -> None:
    """Hugging Face's layers inside a block fz checkpoints drop their cache arguments as they do
    under their own checkpointing (`use_cache=False`, `cache=None`): T5's decoder otherwise writes
    its cache again when fz recomputes the block, and torch finds other tensors saved. Their
    checkpointing is on, its function a direct call (fz's checkpoint is around the block). Once."""
    if block.__dict__.get("_fz_hf_direct"):
        return
    for m in block.modules():
        if hasattr(type(m), "_can_checkpoint_with_cache"):  # transformers' GradientCheckpointingLayer
            m.__dict__.update(gradient_checkpointing=True, _gradient_checkpointing_func=_direct)
    block.__dict__["_fz_hf_direct"] = True


def _take_hf_checkpointing(block: nn.Module) -> bool:
    """Hugging Face's gradient checkpointing inside a block (`gradient_checkpointing = True` on its
    layers) would recompute the block in backward with fz's meta tensors: it is turned off in fz's
    copy and fz checkpoints the whole block instead (the same recompute, its gather included)."""
    found = False
    for m in block.modules():
        if getattr(m, "gradient_checkpointing", False) is True:
            m.gradient_checkpointing = False  # type: ignore[assignment]  # torch: Module.__setattr__ typed Tensor | Module
            found = True
    return found
