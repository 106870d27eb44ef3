"""NaN and inf in loaded weights are named at load, not found later as a run that skips every step.

A parameter loaded with a NaN makes every gradient non-finite, so `Spec(nonfinite="skip")` would
skip every step without a word. The loaders (`fz.init(weights=)`, `fz.load_weights`,
`fz.import_deepspeed`, `fz.restore`) count the non-finite values of each parameter (and, from a
checkpoint, of the optimizer's moments) as the values arrive: each chunk read gets one mask of
its own size, never a second read of the files nor a copy of the model. Each rank counts only
its Shard(0) rows, even of a tensor it reads whole, so a shard group's sum counts every value
once (on a 2-D mesh each replica group's sum is the same); every rank gets that sum and raises
`fz.NonFiniteError` (or, with `allow_nonfinite=True`, warns with the counts) alike. Of a buffer,
NaN and +inf are counted, not -inf: a mask buffer may hold -inf on purpose. Kinds that cannot be negative (Adam's
`exp_avg_sq`, a mean of squares, whose square root the step takes) have their negative values
counted too, in the same all-reduce.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from fz.errors import NonFiniteError
from fz.sharding.plan import ShardPlan
from fz.sharding.settle import Handle

_SHOWN = 8
_CHUNK = 4 << 20  # elements per mask when a whole tensor is counted
_MINMAX = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # aminmax's dtypes (not fp8's, on the CPU)


def nonfinite(t: Tensor) -> int:
    """How many values of `t` are NaN or inf (0 for an integer tensor), in chunks of bounded masks."""
    if not (t.is_floating_point() or t.is_complex()):
        return 0
    flat, bad = t.detach().reshape(-1), 0
    for piece in flat.split(_CHUNK):
        if piece.dtype in _MINMAX and piece.numel():
            # the common case in one pass without a temporary (isfinite takes an abs() of the piece's
            # size: a loader's peak of a second chunk); NaN and inf both reach the min or the max
            lo, hi = torch.aminmax(piece)
            if math.isfinite(float(lo)) and math.isfinite(float(hi)):
                continue
        ok = torch.isfinite(piece)
        bad += piece.numel() - int(ok.sum())
    return bad


def nonfinite_as(dtype: torch.dtype) -> Callable[[Tensor], int]:
    """`nonfinite` of a tensor's values as they land cast to `dtype` (a master's 1e5 is inf in an
    fp16 parameter): its range checked first, a piece cast only where it reaches past it."""
    top = torch.finfo(dtype).max

    def count(t: Tensor) -> int:
        if not t.is_floating_point() or torch.finfo(t.dtype).max <= top:
            return nonfinite(t)
        bad = 0
        for piece in t.detach().reshape(-1).split(_CHUNK):
            lo, hi = torch.aminmax(piece) if piece.numel() else (piece.new_zeros(()), piece.new_zeros(()))
            if math.isfinite(float(lo)) and math.isfinite(float(hi)) and max(-float(lo), float(hi)) <= top:
                continue
            bad += piece.numel() - int(torch.isfinite(piece.to(dtype)).sum())
        return bad

    return count


def buffer_nonfinite(t: Tensor) -> int:
    """How many values of a buffer are NaN or +inf: running statistics a NaN poisons; -inf is a
    mask's (an attention bias), kept."""
    if not t.is_floating_point():
        return 0
    return sum(int(torch.isnan(piece).sum()) + int(torch.isposinf(piece).sum())
               for piece in t.detach().reshape(-1).split(_CHUNK))


def buffers_found(buffers: Mapping[str, Tensor]) -> dict[str, tuple[int, int]]:
    """{label: (NaN or +inf values, values)} of loaded buffers (whole on every rank: one rank counts)."""
    counts = {f"buffer {name!r}": (buffer_nonfinite(t), t.numel()) for name, t in buffers.items()}
    return {label: c for label, c in counts.items() if c[0]}


def negative(t: Tensor) -> int:
    """How many values of `t` are < 0 (NaN is not), in chunks of bounded masks."""
    return sum(int((piece < 0).sum()) for piece in t.detach().reshape(-1).split(_CHUNK))


class Counts:
    """Non-finite values of each parameter (and moment `kind`) read on this rank, counted over the
    rows it holds in the Shard(0) layout: each shard group's ranks together count every row once."""

    def __init__(self, plan: ShardPlan, kinds: tuple[str, ...] = ("",), nonnegative: tuple[str, ...] = ()):
        self.plan, self.kinds, self.nonnegative = plan, kinds, nonnegative
        self.slots = {name: s for name, (_, s) in sorted(plan.slots().items())}
        self.bad: dict[tuple[str, str], int] = {}
        self.below: dict[tuple[str, str], int] = {}
        self.negative: dict[str, tuple[int, int]] = {}  # total()'s sums of `below`, labelled as its result
        self.buffers: dict[str, tuple[int, int]] = {}  # buffer: (non-finite values, values), the same on every rank

    def see(self, name: str, at: int, chunk: Tensor, kind: str = "") -> None:
        """Count the non-finite values (and, of a `nonnegative` kind, the negative ones) of elements
        [at, at + len(chunk)) of `name` that this rank counts."""
        s = self.slots.get(name)
        if s is None:  # a buffer: whole on every rank, which counts all of it
            seen = self.buffers.get(name, (0, 0))
            self.buffers[name] = (seen[0] + buffer_nonfinite(chunk), seen[1] + chunk.numel())
            return
        start, stop = s.local_rows(self.plan.shard_rank)
        a, z = max(at, start * s.row_numel), min(at + chunk.numel(), stop * s.row_numel)
        if a < z:
            part = chunk.reshape(-1)[a - at:z - at]
            n = nonfinite(part)
            if n:
                self.bad[kind, name] = self.bad.get((kind, name), 0) + n
            m = negative(part) if kind in self.nonnegative else 0
            if m:
                self.below[kind, name] = self.below.get((kind, name), 0) + m

    def total(self) -> dict[str, tuple[int, int]]:
        """{label: (non-finite values, values)} summed over the shard group (each replica group holds
        every row): the same on every rank of the mesh. One all-reduce of an int64 per parameter and kind;
        the negative values of the `nonnegative` kinds, summed in it, are left in `self.negative`."""
        keys = [(k, n) for k in self.kinds for n in self.slots]
        below = [(k, n) for k in self.nonnegative for n in self.slots]
        counts = torch.tensor([self.bad.get(key, 0) for key in keys] + [self.below.get(key, 0) for key in below],
                              dtype=torch.int64)
        if self.plan.shards > 1:
            counts = counts.to(self.plan.device)
            Handle([counts]).add(dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=self.plan.shard_group,
                                                 async_op=True)).wait()
        summed = counts.tolist()
        self.negative = {f"{n!r} {k}": (int(c), self.slots[n].numel) for (k, n), c in zip(below, summed[len(keys):])
                         if c}
        return {**{f"{n!r}" + (f" {k}" if k else ""): (int(c), self.slots[n].numel)
                   for (k, n), c in zip(keys, summed) if c},
                **{f"buffer {n!r}": (c, total) for n, (c, total) in self.buffers.items() if c}}


def owned_locals(tensors: Mapping[str, Tensor], first_rank: bool,
                 counted_as: Mapping[str, Callable[[Tensor], int]] | None = None) -> dict[str, tuple[int, int]]:
    """{label: (non-finite values, values)} of a loaded state's tensors in memory (fz.restore),
    each counted on the ranks whose local part no other rank counts: a DTensor where this rank is
    the first along every mesh dimension it is replicated on; a plain tensor on the first rank.
    `counted_as`: a key's own count (`nonfinite_as`: as cast to its parameter's dtype)."""
    counted_as = counted_as or {}
    out = {}
    for key, t in tensors.items():
        if isinstance(t, DTensor):
            coord: Sequence[int] = t.device_mesh.get_coordinate() or ()
            if any(isinstance(p, Replicate) and c != 0 for p, c in zip(t.placements, coord)):
                continue
            n = counted_as.get(key, nonfinite)(t._local_tensor)
        else:
            n = counted_as.get(key, nonfinite)(t) if first_rank else 0
        if n:
            out[repr(key.removeprefix("model/"))] = (n, t.numel())
    return out


def summed(per_rank: Sequence[Mapping[str, Sequence[int]]]) -> dict[str, tuple[int, int]]:
    """One {label: (non-finite values, values)} from every rank's `owned_locals` (exchanged as JSON)."""
    out: dict[str, tuple[int, int]] = {}
    for found in per_rank:
        for label, (n, numel) in found.items():
            out[label] = (out.get(label, (0, 0))[0] + n, numel)
    return out


def report(found: Mapping[str, tuple[int, int]], allow: bool, who: str, source: str, stacklevel: int = 2, *,
           remedy: str = "pass allow_nonfinite=True to load them anyway (a warning)") -> None:
    """NonFiniteError naming the tensors of `found` ({label: (non-finite values, values)}), ending
    with `remedy`, or a warning with the counts when `allow` (allow_nonfinite=True; `stacklevel`
    as in warnings.warn, from the caller); nothing when it is empty."""
    if not found:
        return
    shown = ", ".join(f"{label} {n} of {numel}" for label, (n, numel) in sorted(found.items())[:_SHOWN])
    more = f", ... and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
    values = sum(n for n, _ in found.values())
    what = f"{who}: {source} holds NaN or inf in {len(found)} tensors ({values} values): {shown}{more}"
    if allow:
        warnings.warn(f"{what}. Loaded as they are (allow_nonfinite=True).", stacklevel=stacklevel + 1)
        return
    raise NonFiniteError(f"{what}. Training from them would skip every step; {remedy}.")


class Tally:
    """What a writer of weights (`fz consolidate`) streams, counted as written (after a cast, where a
    value beyond the dtype's range becomes inf): `check()` refuses them before the last file is
    finished, so nothing is left written."""

    def __init__(self, who: str, source: str, cast: torch.dtype | None):
        self.who, self.source, self.cast = who, source, cast
        self.bad: dict[str, tuple[int, int]] = {}
        self.made = 0  # of those, values the cast made inf (finite before it)

    def see(self, name: str, written: Tensor, numel: int, read: Tensor | None = None) -> None:
        """`written`: what goes to the file; `read`: the chunk before a cast (None: the same)."""
        n = nonfinite(written)
        if n:
            self.bad[repr(name)] = (self.bad.get(repr(name), (0, 0))[0] + n, numel)
            if read is not None and read is not written:
                self.made += n - nonfinite(read)

    def check(self) -> None:
        made = self.made > 0
        cast = f" cast to {str(self.cast).removeprefix('torch.')}" if made and self.cast is not None else ""
        remedy = "nothing was written" + (" (without the cast, or cast to bfloat16, whose range is float32's, the "
                                          "values may fit)" if made else "")
        report(self.bad, False, self.who, self.source + cast, remedy=remedy)
