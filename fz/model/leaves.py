"""The root's leaves as units: what stage 3 with offloaded parameters fetches per use.

What no block holds is the root (fz/model/skeleton.py), gathered when the model's forward
starts and held until backward ends. For a language model that is the embeddings, the
final norm and the LM head: two of the largest tensors, on the device for the whole step.
When the parameters live off the device (`Spec(offload=...(params=True))`, stage 3), the
device should hold only what is in flight, so each module of the root that owns
parameters directly (and has no part that owns any: an `nn.Embedding`, the head's
`nn.Linear`, a norm) becomes a unit of its own: gathered when it is called, released
after, gathered again for its backward if autograd needs it, prefetched like a block.
What stays with the root is what it uses directly (`self.pos_emb` as an `nn.Parameter`),
parameters of modules that also have parts with parameters, and anything tied to those.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.nn as nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def fetches_root(spec: Any) -> bool:
    """Whether `spec` takes the root's leaves out as units: stage 3 with the parameters off the
    device. With them on the device the root stays whole: one gather a step, not one per use."""
    offload = spec.offload
    return spec.stage == 3 and offload is not None and offload.params != "device"


def _inside(name: str, units: Sequence[str]) -> bool:
    return any(name == u or name.startswith(u + ".") for u in units)


def root_leaves(root: nn.Module, blocks: Sequence[str]) -> list[str]:
    """Names of the root's modules (outside `blocks`) that own parameters directly, have no part
    owning any, and have a forward of their own (a ParameterList is read, not called)."""
    out = []
    for name, module in root.named_modules():
        if not name or isinstance(module, _CONTAINERS) or _inside(name, blocks):
            continue
        if type(module).forward is nn.Module.forward:
            continue
        if not any(p is not None for p in module._parameters.values()):
            continue
        if any(True for child in module.children() for _ in child.parameters()):
            continue
        out.append(name)
    return out


def occurrences(root: nn.Module, units: Sequence[str]) -> dict[str, list[str]]:
    """Every name under which each unit's module sits outside the units (a module the model
    registers twice, as T5 once shared its embedding, gets one stand-in at each)."""
    by_id = {id(root.get_submodule(u)): u for u in units}
    out: dict[str, list[str]] = {u: [] for u in units}
    for name, module in root.named_modules(remove_duplicate=False):
        unit = by_id.get(id(module))
        if unit is not None and name and not _inside(name.rpartition(".")[0], units):
            out[unit].append(name)
    return out
