"""Which module tensor each parameter of a stage-0 DeepSpeed optimizer is: its files do not name them.

The optimizer's state lists its parameters group by group. Each group lists its own in module order
(groups made by filtering `named_parameters`, as Hugging Face's Trainer makes its weight-decay and
no-decay groups, do), so each group is an ordered subsequence of the module's tensors, matched by
shape; a tensor in no group is frozen. The groups interleave in the module, so a greedy walk cannot
place them: `assign` follows every way the shapes fit. One way is taken; several are narrowed by what
the caller knows (`fits`: a master's values, the target model's trainable names), and are otherwise
left to the caller, since a wrong pick puts one tensor's moments on another.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fz.ckpt.deepspeed import unpickle as ds_pickle
from fz.ckpt.deepspeed.unpickle import Lazy
from fz.errors import CheckpointError

Shape = tuple[int, ...] | None  # None: the optimizer holds no state for it yet, so any shape fits
Placed = tuple[int, ...]  # parameters placed so far, per group
MAX_WAYS = 200_000  # partial placements followed at once: beyond, the shapes say too little to place them
MAX_KEPT = 1_000_000  # partial placements kept in all (for the walk back): bounds a crafted file's time and memory


def assign(names: list[str], shapes: dict[str, tuple[int, ...]], groups: list[list[Shape]], file: Path | str,
           fits: Callable[[str, int, int], bool] | None = None) -> tuple[list[list[str]], bool]:
    """(each group's module names in the group's order, whether that is the only placement): `groups`
    (each a list of shapes) as disjoint ordered subsequences of `names`, a name in no group frozen.
    `fits(name, group, index)`, when given, must also hold for a name placed there (`name, -1, -1`:
    left frozen); it is asked only where the shapes alone leave several placements. CheckpointError
    when none fits."""
    need = tuple(len(g) for g in groups)
    if sum(need) > len(names):
        raise CheckpointError(f"{file}: the optimizer has {sum(need)} parameters, the module only {len(names)} tensors")
    layers = _layers(names, shapes, groups, file, None)
    if _ways(layers, need) > 1 and fits is not None:
        narrowed = _layers(names, shapes, groups, file, fits)
        if need in narrowed[-1]:
            layers = narrowed
    if need not in layers[-1]:
        raise CheckpointError(f"{file}: the optimizer's {sum(need)} parameters ({len(groups)} group(s)) do not "
                              "match the module's tensors in order and shape")
    out: list[list[str]] = [[] for _ in groups]
    placed = need
    for i in range(len(names), 0, -1):
        _, before, g = layers[i][placed]
        if g >= 0:
            out[g].append(names[i - 1])
        placed = before
    return [o[::-1] for o in out], _ways(layers, need) == 1


def _ways(layers: list[dict[Placed, tuple[int, Placed, int]]], need: Placed) -> int:
    return layers[-1][need][0] if need in layers[-1] else 0


def _layers(names: list[str], shapes: dict[str, tuple[int, ...]], groups: list[list[Shape]], file: Path | str,
            fits: Callable[[str, int, int], bool] | None) -> list[dict[Placed, tuple[int, Placed, int]]]:
    """Per name read, every placement reachable so far: {placed: (ways to reach it, at most 2; the
    placement before; the group this name went to, -1 frozen)}."""
    need = tuple(len(g) for g in groups)
    total = sum(need)
    layers: list[dict[Placed, tuple[int, Placed, int]]] = [{(0,) * len(need): (1, (), -1)}]
    kept = 1
    for i, name in enumerate(names):
        left = len(names) - i - 1
        nxt: dict[Placed, tuple[int, Placed, int]] = {}
        for placed, (ways, _, _) in layers[-1].items():
            moves = [g for g, group in enumerate(groups)
                     if placed[g] < need[g] and group[placed[g]] in (None, shapes[name])]
            for g in [*moves, -1]:  # -1: frozen, in no group
                to = placed if g < 0 else placed[:g] + (placed[g] + 1,) + placed[g + 1:]
                if left < total - sum(to) or (fits is not None and not fits(name, g, placed[g] if g >= 0 else -1)):
                    continue
                got = nxt.get(to)
                nxt[to] = (ways, placed, g) if got is None else (min(2, got[0] + ways), got[1], got[2])
        kept += len(nxt)
        if len(nxt) > MAX_WAYS or kept > MAX_KEPT:
            raise CheckpointError(f"{file}: the optimizer's {len(groups)} parameter groups fit the module's tensors "
                                  f"in more than {MAX_WAYS if len(nxt) > MAX_WAYS else MAX_KEPT} partial ways by "
                                  "shape; the file does not name them")
        layers.append(nxt)
    return layers


def stage0_names(module: dict[str, Any], buffers: set[str], groups: list[list[Any]], masters: list[list[Lazy]],
                 trainable: frozenset[str] | None, file: Path | str) -> tuple[list[str], bool]:
    """(the module names of a stage-0 optimizer's params, group after group; whether they are placed
    for sure). The module's tensors (buffers and tied aliases left out) are matched by shape, and where
    that leaves several ways, by the masters' values (a bf16 weight is its fp32 master, rounded) and
    the target's `trainable` names. Several ways left with masters to place is an error; without them
    (fp32: the module's tensors are the masters) the weights are right whichever way, and only the
    moments cannot be placed: the caller leaves them out."""
    seen: set[tuple[int, int]] = set()
    names = []
    for name, t in module.items():
        if name in buffers or not isinstance(t, Lazy) or (t.at, t.offset) in seen:
            continue
        seen.add((t.at, t.offset))
        names.append(name)
    if not groups:
        return names, True
    same: dict[tuple[str, int, int], bool] = {}

    def fits(name: str, g: int, j: int) -> bool:
        if trainable is not None and (g >= 0) != (name in trainable):
            return False
        if g < 0 or not masters:
            return True
        if (name, g, j) not in same:
            weight = ds_pickle.materialize(module[name])
            same[name, g, j] = torch.equal(ds_pickle.materialize(masters[g][j]).to(weight.dtype), weight)
        return same[name, g, j]
    shapes = {n: tuple(module[n].shape) for n in names}
    placed, sure = assign(names, shapes, [[None if s is None else tuple(s) for s in g] for g in groups], file, fits)
    if not sure and masters:
        raise CheckpointError(f"{file}: the optimizer's {sum(map(len, groups))} master weights fit the module's "
                              "tensors in more than one way by shape and value, and a stage-0 file does not name them")
    return [n for g in placed for n in g], sure
