"""Backward's first ops, replayed on the traced graph: what they hold before any block's backward.

A language model's device peak is often here: the loss's saved tensors and the gradients of
its vocabulary-wide logits, two or three tensors of the largest size, alive together. How many
depends on the ops and dtypes (on CUDA bf16 cross-entropy saves a bf16 log-softmax and an fp32
copy of it, and its backward holds one fp32 gradient beside them; under the CPU's autocast the
log-softmax is fp32 and its backward holds two), so rather than a rule the traced forward's own
autograd graph is replayed as the engine runs it: ready nodes highest sequence number first, each
node making its inputs' gradients (the shapes and dtypes the graph records) before its incoming
gradient and its saved tensors are freed (no other node saving them). The replay stops at the
first node that saves a block's tensor: from there the units' backward (fz/planning/activations.py)
counts, block by block. Parameters' gradients are not counted here: the estimate's gradient
terms hold them.
"""
from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterator

import torch
from torch import Tensor
from torch.autograd.graph import Node


def _saved(node: Node) -> Iterator[Tensor]:
    """The tensors `node` saved for its backward (built-in ops' `_saved_*`, a custom Function's saved_tensors)."""
    names = [n for n in dir(node) if n.startswith("_saved_")] or \
        (["saved_tensors"] if hasattr(node, "saved_tensors") else [])
    for name in names:
        value = getattr(node, name)
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, Tensor):
                yield v


def _grad_bytes(node: Node, nr: int) -> int:
    meta = node._input_metadata[nr]
    return int(torch.Size(meta.shape).numel()) * meta.dtype.itemsize


def _is_leaf(node: Node) -> bool:
    return type(node).__name__ == "AccumulateGrad"


def first_ops_peak(loss: Tensor, key: Callable[[Tensor], int], unit_of: dict[int, str],
                   nbytes: Callable[[Tensor], int]) -> int:
    """The most bytes backward's first ops hold above what the forward left (the gradients in
    flight, less the saved tensors already freed), from `loss` until the first node that saves a
    block's tensor. `key(t)` names a saved tensor's storage; `unit_of[key]` is the block that saved
    it ("" the root; absent: a parameter, not an activation)."""
    root = loss.grad_fn
    if root is None:
        return 0
    deps: Counter = Counter()
    holders: Counter = Counter()
    saved: dict = {}
    sizes: dict[int, int] = {}
    seen, stack = {root}, [root]
    while stack:
        node = stack.pop()
        keys = set()
        for t in _saved(node):
            k = key(t)
            if k in unit_of:
                keys.add(k)
                sizes[k] = nbytes(t)
        saved[node] = keys
        holders.update(keys)
        for f, _ in node.next_functions:
            if f is not None:
                deps[f] += 1
                if f not in seen:
                    seen.add(f)
                    stack.append(f)
    pending: dict = {root: {0: int(loss.numel()) * loss.element_size()}}
    live = peak = sum(pending[root].values())
    ready = [(-root._sequence_nr(), 0, root)]
    order = 1
    while ready:
        node = heapq.heappop(ready)[2]
        if any(unit_of[k] for k in saved[node]):
            break  # a block's backward: the units' count from here
        made = 0
        for f, nr in node.next_functions:
            if f is None or _is_leaf(f):
                continue
            into = pending.setdefault(f, {})
            if nr not in into:  # a second gradient for the same input is summed into the first
                into[nr] = _grad_bytes(f, nr)
                made += into[nr]
        peak = max(peak, live + made)
        live += made - sum(pending.pop(node, {}).values())
        for k in saved[node]:
            holders[k] -= 1
            if not holders[k]:
                live -= sizes[k]
        for f, _ in node.next_functions:
            if f is None:
                continue
            deps[f] -= 1
            if not deps[f] and not _is_leaf(f):  # a leaf's gradient is the estimate's gradient terms'
                heapq.heappush(ready, (-f._sequence_nr(), order, f))
                order += 1
    return peak
