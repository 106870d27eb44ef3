"""What the estimator needs to know about a model: its parameters in bucket order, by unit.

From a model (built on the meta device or not: only shapes are read) through the same
skeleton and bucket order `fz.init` uses, or from raw counts (total parameters, largest
layer), as DeepSpeed's estimator takes them: then every layer is one unit of one tensor,
and the root holds none, as at stage 3 with offloaded parameters, where the root's leaves
(embeddings, head) are fetched per use like blocks (fz/model/leaves.py).

Two sizes are kept apart because DeepSpeed's users compare them: the *largest layer* is
DeepSpeed's (`model_to_params` in deepspeed/runtime/zero/stage3.py: the most parameters one
module holds itself, a 7B Llama's 131M-parameter embedding), the number its estimator is
given; the *largest unit* is what one fz gather holds at most (a whole block, or the root's
embedding and head together when the root is not fetched per use: 262M there).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from fz.errors import ConfigError
from fz.model.skeleton import bucket_entries, build_skeleton

Entry = tuple[str, torch.Size, int, bool]  # (name, shape, unit, trainable)


@dataclass(frozen=True)
class Counts:
    """Raw counts, as DeepSpeed's estimator takes them: total parameters and the largest layer's."""

    total_params: int
    largest_layer: int

    def __post_init__(self) -> None:
        if not (isinstance(self.total_params, int) and isinstance(self.largest_layer, int)) \
                or not 0 < self.largest_layer <= self.total_params:
            raise ConfigError(f"fz.estimate: counts need 0 < largest_layer <= total_params (integers), got "
                              f"total_params={self.total_params!r}, largest_layer={self.largest_layer!r}")


@dataclass(frozen=True)
class ModelCounts:
    entries: tuple[Entry, ...]
    unit_names: tuple[str, ...]  # unit index -> the block activations are traced by ("": the root and its leaves)
    buffer_bytes: int
    model: nn.Module | None  # None for raw counts (no activations can be traced)
    fetches_root: bool = True  # the root's leaves are units (raw counts: every layer is one)
    shared: dict[str, tuple[int, ...]] = field(default_factory=dict)  # param -> the units gathering it, when several do
    largest_layer: int = 0  # DeepSpeed's largest layer: the most parameters one module holds itself

    @property
    def num_params(self) -> int:
        return sum(math.prod(e[1]) for e in self.entries)

    @property
    def largest_unit(self) -> int:
        """Elements of the largest unit (the root included): what one fz gather holds at most."""
        per: dict = {}
        for _, shape, unit, _ in self.entries:
            per[unit] = per.get(unit, 0) + math.prod(shape)
        return max(per.values())


def model_counts(model_or_counts: nn.Module | Counts | tuple[float, float],
                 wrap: Callable[[str, nn.Module], bool] | None = None, fetch_root: bool = False) -> ModelCounts:
    """The parameters of a model (or of raw counts) in the order fz.init buckets them
    (`fetch_root`: the root's leaves as units, fz/model/leaves.py)."""
    if isinstance(model_or_counts, nn.Module):
        skel = build_skeleton(model_or_counts, wrap, fetch_root)
        buffers = sum(b.numel() * b.element_size() for b in model_or_counts.buffers())
        return ModelCounts(tuple(bucket_entries(model_or_counts, skel)),
                           tuple("" if u.leaf else u.name for u in skel.units), buffers, model_or_counts,
                           skel.fetches_root, skel.shared, deepspeed_largest_layer(model_or_counts))
    if isinstance(model_or_counts, tuple) and len(model_or_counts) == 2:
        model_or_counts = Counts(int(model_or_counts[0]), int(model_or_counts[1]))
    if not isinstance(model_or_counts, Counts):
        raise ConfigError(f"fz.estimate needs an nn.Module, fz.planning.Counts or (total_params, largest_layer), "
                          f"got {type(model_or_counts).__name__}")
    total, largest = model_or_counts.total_params, model_or_counts.largest_layer
    layers = -(-total // largest)
    entries: list[Entry] = []
    for i in range(layers):
        numel = min(largest, total - i * largest)
        entries.append((f"layer{i}", torch.Size((numel,)), i + 1, True))
    return ModelCounts(tuple(entries), ("", *(f"layer{i}" for i in range(layers))), 0, None, largest_layer=largest)


def deepspeed_largest_layer(model: nn.Module) -> int:
    """DeepSpeed's largest layer, as its `model_to_params` (deepspeed/runtime/zero/stage3.py) counts
    it: over every module, the parameters it holds itself (`parameters(recurse=False)`), so a
    block of several Linears counts as its largest Linear. Its estimator is given this number."""
    return max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
