"""Activation bytes, measured: one micro-batch traced with fake tensors (no memory, no compute).

The model runs as fz runs it (its parameters in the compute dtype, under autocast in mixed
precision) with every tensor a FakeTensor; a saved-tensors hook records what autograd keeps
for backward, attributed to the unit (block) running when it was saved. Parameters (and
views of them) are not activations: fz counts them as parameters or gathered buckets.
With activation checkpointing a checkpointed block keeps only its inputs, and backward
recomputes one block at a time, so the peak is the inputs of every block plus the largest
block's own saved tensors.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module

from fz.errors import ConfigError
from fz.precision import PRECISIONS
from fz.step.batches import batch_map


@dataclass(frozen=True)
class Trace:
    saved: dict[str, int]  # unit name ("" = the root) -> bytes autograd saves in its forward (units in order)
    inputs: dict[str, int]  # unit name -> bytes of its tensor inputs (what a checkpointed block keeps)
    largest: int  # the largest single saved tensor (e.g. a language model's logits)

    def peaks(self, checkpointed: Callable[[str], bool], grads: dict[str, int],
              grads_stay: bool = True) -> tuple[int, int, int]:
        """(activation bytes at the forward's end, activations + gradients at backward's first op,
        activations + gradients at the worst point of the units' backward).

        `checkpointed(unit)` says which blocks recompute; `grads[unit]` is the gradient bytes a
        unit's backward makes. Backward starts with every activation the forward left (a
        checkpointed block's inputs, not yet its recompute) plus one op's incoming and outgoing
        gradient (each at most the largest activation), before any unit's gradient exists; then,
        block by block from the last, a block's saved tensors (recomputed if checkpointed) live
        beside the earlier blocks' and the gradients made so far (`grads_stay`), or only its own
        (they leave the device as they are reduced: an offloaded optimizer,
        fz/offload/host_grads.py). The two are apart because what else the device holds differs:
        no reduction is in flight at the first op.
        """
        blocks = [u for u in self.saved if u]
        kept = {u: self.inputs[u] if checkpointed(u) else self.saved[u] for u in blocks}
        recompute = max((self.saved[u] for u in blocks if checkpointed(u)), default=0)
        left = self.saved.get("", 0) + sum(kept.values())  # what the forward leaves for backward
        forward = left + recompute  # and the last checkpointed block's tensors while it runs
        # no block is recomputed yet at backward's first op (a 2.8B GPT's peak on an H200 holds
        # the loss's tensors and every block's input, none of a block's inside)
        start, made, units = left + 2 * self.largest, grads.get("", 0), 0
        for i in range(len(blocks) - 1, -1, -1):
            u = blocks[i]
            made = made + grads.get(u, 0) if grads_stay else grads.get(u, 0)
            units = max(units, sum(kept[v] for v in blocks[:i]) + self.saved[u] + made)
        return forward, start, units


def _base(t: Tensor) -> Tensor:
    while t._base is not None:
        t = t._base
    return t


def _nbytes(t: Tensor) -> int:
    return t.untyped_storage().nbytes()


def default_batch(micro_batch: int, seq_len: int) -> Tensor:
    """Token ids [micro_batch, seq_len] (what a language model's loss_fn receives)."""
    return torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")


def trace(model: nn.Module, unit_names: tuple[str, ...], batch: Any, precision: str,
          loss_fn: Callable[[nn.Module, Any], Any] | None = None) -> Trace:
    """Run one forward of `model` on `batch` (shapes only: real or meta tensors) with fake tensors."""
    dtype = PRECISIONS[precision]
    saved: dict[str, dict[int, int]] = {u: {} for u in unit_names}
    inputs: dict[str, int] = {u: 0 for u in unit_names if u}
    current = [""]
    param_ids: set = set()

    def pack(t: Tensor) -> Tensor:
        base = _base(t)
        if id(base) not in param_ids:
            saved[current[0]][id(base)] = _nbytes(base)
        return t

    def enter(name: str) -> Callable[[nn.Module, tuple, dict[str, Any]], None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            inputs[name] = sum(_nbytes(_base(a)) for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, Tensor))
            current[0] = name
        return hook

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        current[0] = ""

    handles = []
    for name in dict.fromkeys(n for n in unit_names[1:] if n):  # "": the root, or a leaf of it
        m = model.get_submodule(name)
        handles += [m.register_forward_pre_hook(enter(name), with_kwargs=True), m.register_forward_hook(leave)]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with mode:
            canon: dict[int, Tensor] = {}
            tensors: dict[str, Tensor] = {}
            for name, p in model.named_parameters(remove_duplicate=False):
                if id(p) not in canon:
                    canon[id(p)] = torch.empty(p.shape, dtype=dtype, requires_grad=p.requires_grad)
                tensors[name] = canon[id(p)]
            for name, b in model.named_buffers(remove_duplicate=False):
                tensors[name] = torch.empty(b.shape, dtype=b.dtype)
            param_ids.update(id(t) for t in canon.values())
            fake_batch = batch_map(lambda x: torch.empty(x.shape, dtype=x.dtype) if isinstance(x, Tensor) else x, batch)
            autocast = torch.autocast("cpu", dtype=dtype, enabled=precision != "fp32")
            with _reparametrize_module(model, tensors), autocast, \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = loss_fn(model, fake_batch) if loss_fn is not None else model(fake_batch)
                if getattr(out, "loss", None) is not None:
                    out = out.loss
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - name the cause: the model did not run on this batch
        raise ConfigError(f"fz.estimate: tracing one micro-batch with fake tensors failed ({type(e).__name__}: "
                          f"{e}); pass batch= with one micro-batch of the right shapes and dtypes") from e
    finally:
        for h in handles:
            h.remove()
    largest = max((n for v in saved.values() for n in v.values()), default=0)
    return Trace({u: sum(v.values()) for u, v in saved.items()}, inputs, largest)
