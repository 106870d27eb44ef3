"""A step's batch as micro-batches, and the loss as a scalar (the model's own without a loss_fn): checked.

A batch is any tree of tensors a data loader yields: torch's pytree containers (dict, list,
tuple, namedtuple) and every other `Mapping`, walked as transformers' Trainer walks its inputs
(`BatchEncoding`, which Hugging Face's collators return, a `UserDict`), each rebuilt as its
own type. `MicroBatches` is a step given as its micro-batches, each collated on its own.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from fz.errors import ConfigError


class MicroBatches:
    """One step's micro-batches, each a batch of its own: `fz.train_step(state, MicroBatches([b1,
    b2]))`. Their shapes may differ (a padding collator pads each to its own longest row, as
    transformers' Trainer collates each micro-batch), and so may their count from step to step
    (an epoch's last, shorter step). `fz.data.loader(..., split=True)` yields them."""

    def __init__(self, batches: Iterable[Any]):
        self.batches = tuple(batches)
        if not self.batches:
            raise ConfigError("fz.MicroBatches([]): a step needs at least one micro-batch")

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)

    def __getitem__(self, i: int) -> Any:
        return self.batches[i]

    def __repr__(self) -> str:
        return f"fz.MicroBatches({len(self.batches)} micro-batches)"


def _other_mapping(x: Any) -> bool:
    """A Mapping torch's pytree does not take apart (BatchEncoding, UserDict): walked here."""
    return isinstance(x, Mapping) and type(x) not in pytree.SUPPORTED_NODES and not isinstance(x, dict)


def _rebuild(like: Mapping, items: dict[Any, Any]) -> Any:
    try:
        return type(like)(items)  # type: ignore[call-arg]  # as transformers' _prepare_input rebuilds it
    except Exception:  # noqa: BLE001 - a Mapping type that takes no dict: the model gets its items all the same
        return items


def batch_map(fn: Callable[[Any], Any], batch: Any) -> Any:
    """`fn` on every leaf of `batch` (a MicroBatches: of each micro-batch), its containers rebuilt."""
    if isinstance(batch, MicroBatches):
        return MicroBatches(batch_map(fn, b) for b in batch)

    def visit(x: Any) -> Any:
        return _rebuild(x, {k: batch_map(fn, v) for k, v in x.items()}) if _other_mapping(x) else fn(x)
    return pytree.tree_map(visit, batch, is_leaf=_other_mapping)


def batch_leaves(batch: Any) -> list[Any]:
    """The leaves of `batch` in order (of every micro-batch of a MicroBatches)."""
    if isinstance(batch, MicroBatches):
        return [x for b in batch for x in batch_leaves(b)]
    out: list[Any] = []
    for x in pytree.tree_leaves(batch, is_leaf=_other_mapping):
        out += batch_leaves(list(x.values())) if _other_mapping(x) else [x]
    return out


def _rowed(batch: Any) -> list[Tensor]:
    return [x for x in batch_leaves(batch) if isinstance(x, Tensor) and x.dim()]


def rows_of(batch: Any) -> int:
    """The rows of one micro-batch: the leading dimension its tensors share (checked)."""
    rowed = _rowed(batch)
    if not rowed:
        raise ConfigError("the batch holds no tensor with a batch (leading) dimension: give it at least one "
                          f"tensor of shape (rows, ...); 0-d tensors and scalars only ride along (got {_kinds(batch)})")
    sizes = {x.shape[0] for x in rowed}
    if len(sizes) != 1:
        raise ConfigError(
            f"every tensor in the batch needs the same leading (batch) dimension; got {sorted(sizes)}. "
            "Give every tensor of the batch the same rows (0-d tensors and scalars are passed through as they are)"
        )
    size = sizes.pop()
    if size == 0:
        raise ConfigError("the batch is empty (0 rows): every rank needs grad_accum * micro_batch rows per step "
                          "(did this rank's data run out?)")
    return size


def _kinds(batch: Any) -> str:
    leaves = batch_leaves(batch)
    shown = sorted({type(x).__name__ for x in leaves})[:4]
    return f"{len(leaves)} leaves: {', '.join(shown)}" if leaves else f"a {type(batch).__name__} with no leaves"


def micro_batches(batch: Any, n: int, micro: int | None = None) -> list[Any]:
    """`batch` cut into `n` micro-batches along the leading dimension of its tensors. Leaves with
    no batch dimension (0-d tensors such as transformers' `num_items_in_batch`, Python scalars,
    strings) go to every micro-batch unchanged; the other tensors must agree on their rows.
    A MicroBatches is already cut, as its collator made it: each must hold a tensor, of any rows
    (a preference collator stacks each sample's chosen and rejected rows; a padding-free one packs
    its sequences into one row and carries their lengths)."""
    if isinstance(batch, MicroBatches):
        for b in batch:
            if not _rowed(b):
                rows_of(b)  # the error that names what the micro-batch holds
        return list(batch)
    size = rows_of(batch)
    if size % n:
        raise ConfigError(f"batch leading dimension {size} is not divisible by grad_accum={n} "
                          f"(a batch is grad_accum * micro_batch rows of this rank's data){_one_sample(batch, size)}")
    m = size // n
    if micro is not None and m != micro:
        raise ConfigError(f"batch has {size} rows but grad_accum={n} x micro_batch={micro} = {n * micro} "
                          f"(batch sizes are inconsistent with the spec){_one_sample(batch, size)}")
    def cut(i: int) -> Callable[[Any], Any]:
        return lambda x: x.narrow(0, i * m, m) if isinstance(x, Tensor) and x.dim() else x
    return [batch_map(cut(i), batch) for i in range(n)]


def _one_sample(batch: Any, size: int) -> str:
    """A hint for a batch of 1-D tensors only (a sample passed without its rows dimension)."""
    if any(t.dim() > 1 for t in _rowed(batch)):
        return ""
    return f"; its tensors are 1-D: one sample of {size} values? A batch's first dimension is its rows " \
           "(x.unsqueeze(0) for one row)"


def batch_size(batch: Any) -> tuple[int, int]:
    """(rows, elements) of a batch: the leading dimension of its first tensor that has one (summed
    over a MicroBatches' micro-batches), and the numel of those tensors (0-d tensors, such as
    `num_items_in_batch`, ride along uncounted)."""
    if isinstance(batch, MicroBatches):
        sizes = [batch_size(b) for b in batch]
        return sum(r for r, _ in sizes), sum(e for _, e in sizes)
    tensors = _rowed(batch)
    rows = tensors[0].shape[0] if tensors else 1
    return rows, sum(x.numel() for x in tensors)


def on_device(batch: Any, device: torch.device) -> Any:
    """The batch's tensors on the compute device (as Hugging Face's Trainer and JAX's device_put
    do): a batch from a CPU data loader runs on the GPU; tensors already there are not copied."""
    if device.type == "cpu":
        return batch
    return batch_map(lambda x: x.to(device, non_blocking=True) if isinstance(x, Tensor) else x, batch)


def scalar_loss(loss: Any) -> Tensor:
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise ConfigError(f"loss_fn must return a scalar tensor; got {shape}. Reduce it (e.g. .mean()) in loss_fn")
    return loss.reshape(())


_SET_LOSS_FN = ("Set Spec(loss_fn=fn): fn(model, batch) returns the loss, e.g. "
                "`lambda model, b: F.cross_entropy(model(b['x']), b['y'])`")


def default_loss(model: Any, batch: Any) -> Any:
    """model(**batch) for a dict, else model(batch); an output with `.loss` gives that. A forward
    that does not take the batch, or an output that is no scalar, is told as the missing loss_fn."""
    try:
        out = model(**batch) if isinstance(batch, dict) else model(batch)
    except TypeError as e:
        if "argument" not in str(e) or "forward()" not in str(e):
            raise
        how = f"model(**batch) with keys {sorted(map(str, batch))}" if isinstance(batch, dict) else "model(batch)"
        whole = " (a forward that takes the dict whole, as a DeepSpeed script's `model(batch)`: `lambda model, b: " \
            "model(b)`)" if isinstance(batch, dict) else ""
        raise ConfigError(f"the Spec has no loss_fn, so fz called {how}, and the model's forward refused it ({e}). "
                          + _SET_LOSS_FN + whole) from e
    loss = getattr(out, "loss", out)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
        raise ConfigError(f"the Spec has no loss_fn, so fz took the model's output as the loss, and it is {got}, not "
                          f"a scalar (no .loss: labels not passed?). {_SET_LOSS_FN}")
    return loss
