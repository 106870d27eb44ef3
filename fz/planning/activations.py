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

import contextlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.overrides import TorchFunctionMode

from fz.errors import ConfigError
from fz.planning.backward import first_ops_peak
from fz.precision import PRECISIONS
from fz.step.batches import batch_map

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Trace:
    saved: dict[str, int]  # unit name ("" = the root) -> bytes autograd saves in its forward (units in order)
    inputs: dict[str, int]  # unit name -> bytes of its tensor inputs (what a checkpointed block keeps)
    head: int  # the most bytes backward's first ops hold above what the forward left (fz/planning/backward.py)

    def peaks(self, checkpointed: Callable[[str], bool], grads: dict[str, int],
              grads_stay: bool = True) -> tuple[int, int, int]:
        """(activation bytes at the forward's end, activations + gradients at backward's first op,
        activations + gradients at the worst point of the units' backward).

        `checkpointed(unit)` says which blocks recompute; `grads[unit]` is the gradient bytes a
        unit's backward makes. Backward starts with every activation the forward left (a
        checkpointed block's inputs, not yet its recompute) plus what its first ops hold (`head`:
        the loss's gradients, replayed on the traced graph), before any unit's gradient exists; then,
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
        start, made, units = left + self.head, grads.get("", 0), 0
        for i in range(len(blocks) - 1, -1, -1):
            u = blocks[i]
            made = made + grads.get(u, 0) if grads_stay else grads.get(u, 0)
            units = max(units, sum(kept[v] for v in blocks[:i]) + self.saved[u] + made)
        return forward, start, units


def _base(t: Tensor) -> Tensor:
    while t._base is not None:
        t = t._base
    return t


def _storage(t: Tensor) -> int:
    """What a saved tensor is counted by: its storage (views and detached aliases share one)."""
    return t.untyped_storage()._cdata


def _nbytes(t: Tensor) -> int:
    return t.untyped_storage().nbytes()


def default_batch(micro_batch: int, seq_len: int) -> Tensor:
    """Token ids [micro_batch, seq_len] (what a language model's loss_fn receives)."""
    return torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")


class _CudaCrossEntropy(TorchFunctionMode):
    """The trace runs under the CPU's autocast; where CUDA's differs in what it keeps, follow CUDA.
    A 16-bit cross_entropy: the CPU's autocast casts the logits to fp32 first (an fp32 log-softmax,
    saved once); CUDA's runs log_softmax in the logits' dtype and nll_loss in fp32 (a 16-bit
    log-softmax saved, and an fp32 copy of it). Measured on an H200 (benchmarks/RESULTS.md)."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            a = inspect.signature(F.cross_entropy).bind(*args, **kwargs)
            a.apply_defaults()
            x, target, weight = a.arguments["input"], a.arguments["target"], a.arguments["weight"]
            if torch.is_autocast_enabled("cpu") and x.dtype in (torch.bfloat16, torch.float16) \
                    and not target.is_floating_point() and not a.arguments["label_smoothing"] \
                    and a.arguments["size_average"] is None and a.arguments["reduce"] is None:
                with torch.autocast("cpu", enabled=False):
                    lsm = torch.log_softmax(x, 1 if x.dim() > 1 else 0, dtype=x.dtype)
                    return F.nll_loss(lsm.float(), target, None if weight is None else weight.float(),
                                      ignore_index=a.arguments["ignore_index"], reduction=a.arguments["reduction"])
        return func(*args, **kwargs)


def trace(model: nn.Module, unit_names: tuple[str, ...], batch: Any, precision: str,
          loss_fn: Callable[[nn.Module, Any], Any] | None = None, device_type: str = "cpu") -> Trace:
    """Run one forward of `model` on `batch` (shapes only: real or meta tensors) with fake tensors,
    as autocast runs it on `device_type` ("cuda" or "cpu"), and replay backward's first ops."""
    dtype = PRECISIONS[precision]
    saved: dict[str, dict[int, int]] = {u: {} for u in unit_names}
    inputs: dict[str, int] = {u: 0 for u in unit_names if u}
    current = [""]
    param_ids: set = set()

    def pack(t: Tensor) -> Tensor:
        base = _base(t)
        if _storage(base) not in param_ids:
            saved[current[0]][_storage(base)] = _nbytes(base)
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
            param_ids.update(_storage(t) for t in canon.values())
            fake_batch = batch_map(lambda x: torch.empty(x.shape, dtype=x.dtype) if isinstance(x, Tensor) else x, batch)
            autocast = torch.autocast("cpu", dtype=dtype, enabled=precision != "fp32")
            policy = _CudaCrossEntropy() if device_type == "cuda" else contextlib.nullcontext()
            with _reparametrize_module(model, tensors), autocast, policy, \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = loss_fn(model, fake_batch) if loss_fn is not None else model(fake_batch)
                if getattr(out, "loss", None) is not None:
                    out = out.loss
            head = _first_ops(out, saved)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - name the cause: the model did not run on this batch
        raise ConfigError(f"fz.estimate: tracing one micro-batch with fake tensors failed ({type(e).__name__}: "
                          f"{e}); pass batch= with one micro-batch of the right shapes and dtypes") from e
    finally:
        for h in handles:
            h.remove()
    return Trace({u: sum(v.values()) for u, v in saved.items()}, inputs, head)


def _first_ops(out: Any, saved: dict[str, dict[int, int]]) -> int:
    """Backward's first ops replayed on the traced graph; where the graph cannot be read (an op
    whose node hides its saved tensors or its inputs' metadata), one op's incoming and outgoing
    gradient, each at most the largest saved tensor."""
    largest = max((n for v in saved.values() for n in v.values()), default=0)
    root = next((t for t in pytree.tree_leaves(out) if isinstance(t, Tensor) and t.grad_fn is not None), None)
    if root is None:
        return 0
    unit_of = {k: u for u in saved if u for k in saved[u]}
    unit_of.update(dict.fromkeys(saved.get("", {}), ""))  # saved by a block and by the root: the root's
    try:
        return first_ops_peak(root, _storage, unit_of, _nbytes)
    except (AttributeError, RuntimeError, IndexError, TypeError) as e:
        log.debug("fz.estimate: backward's first ops not replayed (%s: %s); counting 2 x the largest",
                  type(e).__name__, e)
        return 2 * largest
