"""Initial parameter values: the user's own, or `reset_parameters()` under a per-module seed.

For a model built on the meta device, each module is materialised alone (peak host
memory ~ the largest module) under a seed derived from (spec.seed, module name), so the
values are the same for every world size and stage; each rank keeps only its rows.
"""
from __future__ import annotations

import hashlib
from typing import Dict, Iterable, List, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from fz.errors import ConfigError


def module_seed(seed: int, module_name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{module_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _owner(name: str) -> Tuple[str, str]:
    mod, _, leaf = name.rpartition(".")
    return mod, leaf


def _materialize_module(module: nn.Module, mname: str, wanted: Iterable[str], seed: int,
                        device: torch.device) -> Dict[str, Tensor]:
    """Direct params/buffers `wanted` of `module`, initialised by its reset_parameters()."""
    if not hasattr(module, "reset_parameters"):
        raise ConfigError(
            f"module {mname or '<root>'!r} ({type(module).__name__}) is on the meta device but has no "
            "reset_parameters(): fz cannot initialise it; build it on the CPU or add reset_parameters()")
    twin = nn.Module.__new__(type(module))
    twin.__dict__ = dict(module.__dict__)
    twin._parameters = {k: (None if p is None else nn.Parameter(torch.empty_like(p, device=device), p.requires_grad))
                        for k, p in module._parameters.items()}
    twin._buffers = {k: (None if b is None else torch.empty_like(b, device=device)) for k, b in module._buffers.items()}
    twin._modules = dict(module._modules)  # children stay on meta: their own turn comes
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(module_seed(seed, mname))
        twin.reset_parameters()
    out = {}
    for leaf in wanted:
        t = twin._parameters.get(leaf)
        t = twin._buffers.get(leaf) if t is None else t
        out[leaf] = t.detach()
    return out


def initial_values(model: nn.Module, names: List[str], seed: int, device: torch.device) -> Dict[str, Tensor]:
    """Full initial values of the canonical parameters/buffers `names` (one module at a time)."""
    tensors = dict(model.named_parameters(remove_duplicate=True))
    tensors.update(model.named_buffers(remove_duplicate=True))
    out: Dict[str, Tensor] = {}
    meta_by_module: Dict[str, List[str]] = {}
    for n in names:
        t = tensors[n]
        if t.is_meta:
            meta_by_module.setdefault(_owner(n)[0], []).append(n)
        else:
            out[n] = t.detach().to(device)
    for mname, full_names in meta_by_module.items():
        module = model.get_submodule(mname)
        vals = _materialize_module(module, mname, [_owner(n)[1] for n in full_names], seed, device)
        for n in full_names:
            out[n] = vals[_owner(n)[1]]
    return out

