"""Where each rank's piece of a collective is, and the sum of the ranks' pieces.

A collective on a bucket moves one piece per rank ([m] elements: its Shard(0) rows of every
parameter, zero-padded). `Rows` says where each rank's piece is without packing it into one
buffer: per rank, (offset in the piece, a 1-D view holding the elements from there), so a
link (fz/distributed/shm.py) copies straight between the parameters' (or gradients') own
layout and its shared slots, a chunk at a time (`spans`).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

Rows = list[list[tuple[int, Tensor]]]


def sum_in_rank_order(out: Tensor, terms: list[Tensor], average: bool) -> None:
    """out = the ranks' terms added in rank order (divided by their count): every sum fz makes of
    the ranks' gradients, here and in the pairwise exchange (fz/sharding/comm.py), so both give
    the same bits on every rank."""
    torch.add(terms[0], terms[1], out=out)
    for t in terms[2:]:
        out.add_(t)
    if average:
        out.div_(len(terms))


def spans(rows: list[tuple[int, Tensor]], o: int, k: int) -> Iterator[tuple[int, Tensor]]:
    """(offset in the chunk, the part of a view) for each view of `rows` in elements [o, o + k)."""
    for at, view in rows:
        lo, hi = max(at, o), min(at + view.numel(), o + k)
        if lo < hi:
            yield lo - o, view[lo - at:hi - at]


def fill(dst: Tensor, pieces: Iterable[tuple[int, Tensor]]) -> None:
    """dst = the spans' values where they are, zeros elsewhere."""
    pieces = list(pieces)
    if sum(v.numel() for _, v in pieces) < dst.numel():
        dst.zero_()
    for at, view in pieces:
        dst[at:at + view.numel()].copy_(view)


def check_sizes(out: Tensor, inp: Tensor, out_numel: int, inp_numel: int) -> None:
    """At the call, not in the link's thread: a wrong argument is the caller's error, not a peer's."""
    if not out.is_contiguous() or out.numel() != out_numel or inp.numel() != inp_numel or out.dtype != inp.dtype:
        raise ValueError(f"a shared-memory collective needs a contiguous output of {out_numel} elements and an "
                         f"input of {inp_numel}, of one dtype; got {tuple(out.shape)} {out.dtype}, "
                         f"{'' if out.is_contiguous() else 'not contiguous, '}and {tuple(inp.shape)} {inp.dtype}")
