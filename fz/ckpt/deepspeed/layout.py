"""Where each parameter's elements live in a DeepSpeed checkpoint: lists of `Piece`s.

A piece says "elements [start, start + n) of the flattened parameter are elements
[src_start, src_start + n) of the stored tensor `src`". The layouts, as DeepSpeed 0.19 writes
them (and as its zero_to_fp32 / ds_to_universal read them back):

- ZeRO 1/2: per param group, the group's flat vector is rank 0's partition, then rank 1's ...
  (each `P` elements long, the last rank's padding cut from `single_partition_of_fp32_groups`);
  the parameters follow `param_shapes[g]` in order, each followed by its
  `param_alignment_paddings` entry. The Adam moments are the same partitions of the base
  optimizer's state for param `g` (with the padding kept).
- ZeRO 3: each rank holds `ceil(numel / world)` elements of every parameter, back to back in
  `param_shapes` order, across its sub-groups (`fp32_flat_groups`); moments alike, per sub-group.
- whole tensors (stage 0, the universal layout, a frozen fragment): one piece.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from fz.ckpt.deepspeed.unpickle import Lazy


@dataclass(frozen=True)
class Piece:
    start: int  # first element of the parameter
    n: int
    src: Lazy
    src_start: int  # first element of the (flattened) stored tensor


Segments = Sequence[tuple[int, int, Lazy]]  # (start in a virtual flat vector, numel, stored tensor)


def cut(segments: Segments, lo: int, n: int, shift: int) -> list[Piece]:
    """The pieces of elements [lo, lo + n) of the vector `segments` make up, placed at
    parameter element `lo + shift`; None where no segment covers an element."""
    out: list[Piece] = []
    hi = lo + n
    for start, numel, src in segments:
        a, b = max(lo, start), min(hi, start + numel)
        if a < b:
            out.append(Piece(a + shift, b - a, src, a - start))
    if sum(p.n for p in out) != n:
        raise ValueError(f"elements [{lo}, {hi}) are not all stored ({sum(p.n for p in out)} found)")
    return out


def whole(t: Lazy) -> list[Piece]:
    return [Piece(0, t.numel, t, 0)]


def zero12(shapes: Sequence[dict[str, tuple[int, ...]]], paddings: Sequence[Sequence[int]] | None,
           groups: Sequence[Sequence[Lazy]], partition: Sequence[int]) -> dict[str, list[Piece]]:
    """ZeRO 1/2: `groups[rank][g]` the stored partitions of group g (fp32 masters or a moment),
    `partition[g]` the elements per rank of group g (padding included)."""
    out: dict[str, list[Piece]] = {}
    for g, group in enumerate(shapes):
        segs = [(r * partition[g], min(parts[g].numel, partition[g]), parts[g]) for r, parts in enumerate(groups)]
        at = 0
        for i, (name, shape) in enumerate(group.items()):
            n = math.prod(shape)
            out[name] = cut(segs, at, n, -at)
            at += n + (paddings[g][i] if paddings is not None else 0)
    return out


def zero3(shapes: Sequence[dict[str, tuple[int, ...]]], groups: Sequence[Sequence[Lazy]]) -> dict[str, list[Piece]]:
    """ZeRO 3: `groups[rank]` the rank's stored sub-group partitions (masters or a moment)."""
    world = len(groups)
    per_rank = []
    for parts in groups:
        segs, at = [], 0
        for t in parts:
            segs.append((at, t.numel, t))
            at += t.numel
        per_rank.append(segs)
    out: dict[str, list[Piece]] = {}
    base = 0
    for group in shapes:
        for name, shape in group.items():
            numel = math.prod(shape)
            c = math.ceil(numel / world)
            pieces: list[Piece] = []
            for r in range(world):
                n = max(0, min(c, numel - r * c))
                if n:
                    pieces += cut(per_rank[r], base, n, r * c - base)
            out[name] = pieces
            base += c
    return out


def fragments(parts: Sequence[Lazy], numel: int) -> list[Piece]:
    """A parameter split over ranks in equal fragments (ZeRO-3's frozen_param_fragments), padding cut."""
    segs, at = [], 0
    for t in parts:
        segs.append((at, t.numel, t))
        at += t.numel
    return cut(segs, 0, numel, 0)


def slice_mappings(mappings: Sequence[Sequence[dict[str, tuple[int, int]]]],
                   groups: Sequence[Sequence[Lazy]]) -> dict[str, list[Piece]]:
    """BF16_Optimizer's files: `mappings[rank][g][name] = (start in the rank's partition, numel)`;
    a parameter's fragments follow each other rank by rank."""
    out: dict[str, list[Piece]] = {}
    for r, per_group in enumerate(mappings):
        for g, mapping in enumerate(per_group):
            for name, (start, n) in mapping.items():
                have = out.setdefault(name, [])
                at = sum(p.n for p in have)
                have.append(Piece(at, n, groups[r][g], start))
    return out


def check(name: str, pieces: list[Piece], numel: int) -> None:
    """Every element of the parameter exactly once, inside the stored tensors."""
    at = 0
    for p in pieces:
        if p.start != at or p.n < 0 or p.src_start < 0 or p.src_start + p.n > p.src.numel:
            raise ValueError(f"parameter {name!r}: its stored pieces do not tile its {numel} elements")
        at += p.n
    if at != numel:
        raise ValueError(f"parameter {name!r} has {numel} elements but {at} are stored")
