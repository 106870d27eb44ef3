"""Optimizer state as DTensors: each param-shaped leaf gets its parameter's optimizer placement.

Transformations see plain local tensors; the State holds DTensors, so a checkpoint knows
every moment's global shape and can reshard it.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.distributed.tensor import DTensor

from fz.errors import ConfigError
from fz.sharding.plan import ShardPlan


def _param_key(path) -> str | None:
    for entry in reversed(path):
        if isinstance(entry, pytree.MappingKey):
            return entry.key
    return None


def _row_statistic(path) -> bool:
    """Optimizer-state fields named `*_rows` hold one value per parameter row (Adafactor's
    factored second moment): sharded along with the rows, though not parameter-shaped."""
    return any(isinstance(e, pytree.GetAttrKey) and e.name.endswith("_rows") for e in path)


def placement_follows_rows(path, leaf: Tensor, expected: torch.Size, sharded: bool) -> bool:
    """A row statistic (`*_rows`) of a sharded parameter: it takes the parameter's placement."""
    return sharded and _row_statistic(path) and leaf.dim() > 0 and leaf.shape[0] == expected[0]


def is_placed_leaf(path, leaf: Tensor, expected: torch.Size, sharded: bool) -> bool:
    """Whether an optimizer-state leaf of a parameter becomes a DTensor with its placement (what
    memory_report counts as optimizer bytes): parameter-shaped (`expected`: its local shape),
    or a row statistic."""
    return leaf.shape == expected or placement_follows_rows(path, leaf, expected, sharded)


def wrap_opt_state(tree: Any, plan: ShardPlan, reuse: dict[int, DTensor] | None = None) -> Any:
    """Local optimizer state -> the same tree with param-shaped leaves as DTensors.

    `reuse` maps id(local tensor) -> an existing DTensor around it (saves rebuilding
    DTensors for state updated in place).
    """
    slots = plan.slots()

    def wrap(path, leaf):
        if not isinstance(leaf, Tensor) or isinstance(leaf, DTensor):
            return leaf
        if reuse is not None and id(leaf) in reuse:
            return reuse[id(leaf)]
        key = _param_key(path)
        if key in slots:
            b, s = slots[key]
            placement = b.place.opt
            expected = s.local_shape(plan.shard_rank) if placement.is_shard() else s.shape
            if leaf.shape == expected:
                return plan.to_dtensor(leaf, s.shape, placement)
            if placement_follows_rows(path, leaf, expected, placement.is_shard()):
                return plan.to_dtensor(leaf, torch.Size((s.rows, *leaf.shape[1:])), placement)
        return leaf

    return pytree.tree_map_with_path(wrap, tree)


def unwrap(tree: Any) -> Any:
    """DTensor leaves -> their local tensors (no copy)."""
    return pytree.tree_map(lambda x: x._local_tensor if isinstance(x, DTensor) else x, tree)


def checked_opt_state(tree: Any, plan: ShardPlan) -> Any:
    """The optimizer state's local tensors, after checking that every DTensor leaf kept by a
    parameter has that parameter's optimizer placements (a ConfigError names the first that did not)."""
    slots = plan.slots()

    def check(path, leaf):
        if not isinstance(leaf, DTensor):
            return leaf
        key = _param_key(path)
        where = "state.opt_state" + "".join(str(k) for k in path)
        if key in slots:
            b, s = slots[key]
            want = plan.placements(b.place.opt)
            if tuple(leaf.placements) != want or leaf.device_mesh != plan.mesh:
                raise ConfigError(f"{where} has placements {tuple(leaf.placements)}; parameter {key!r} keeps its "
                                  f"optimizer state as {want} on {plan.mesh}")
            if leaf.shape[:1] != s.shape[:1] and s.shape:
                raise ConfigError(f"{where} has shape {tuple(leaf.shape)}; parameter {key!r} is {tuple(s.shape)}")
        return leaf._local_tensor

    return pytree.tree_map_with_path(check, tree)


def reuse_map(tree: Any) -> dict[int, DTensor]:
    return {id(x._local_tensor): x for x in pytree.tree_leaves(tree) if isinstance(x, DTensor)}


def merge_opt_states(results: list[Any], every: set[str]) -> Any:
    """One optimizer state from the groups' results: parameter-keyed dicts united, the rest
    (shared scalars, equal in every group) from the last group."""
    last = results[-1]
    if isinstance(last, dict):
        if any(k in every for r in results for k in r):
            out = {}
            for r in results:
                out.update(r)
            return out
        return {k: merge_opt_states([r[k] for r in results], every) for k in last}
    if isinstance(last, tuple) and hasattr(last, "_fields"):
        return type(last)(*(merge_opt_states([r[i] for r in results], every) for i in range(len(last))))
    if isinstance(last, (tuple, list)):
        return type(last)(merge_opt_states([r[i] for r in results], every) for i in range(len(last)))
    return last
