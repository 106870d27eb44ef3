"""A step's batch as micro-batches, and the loss as a scalar: checked, with errors that name the cause."""
from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from fz.errors import ConfigError


def micro_batches(batch: Any, n: int, micro: int | None = None) -> list[Any]:
    """`batch` cut into `n` micro-batches along the leading dimension of its tensors. Leaves with
    no batch dimension (0-d tensors such as transformers' `num_items_in_batch`, Python scalars,
    strings) go to every micro-batch unchanged; the other tensors must agree on their rows."""
    leaves, spec = pytree.tree_flatten(batch)
    rowed = [x for x in leaves if isinstance(x, Tensor) and x.dim()]
    if not rowed:
        raise ConfigError("the batch holds no tensor with a batch (leading) dimension: give it at least one "
                          "tensor of shape (rows, ...); 0-d tensors and scalars only ride along")
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
    if size % n:
        raise ConfigError(f"batch leading dimension {size} is not divisible by grad_accum={n} "
                          f"(a batch is grad_accum * micro_batch rows of this rank's data)")
    m = size // n
    if micro is not None and m != micro:
        raise ConfigError(f"batch has {size} rows but grad_accum={n} x micro_batch={micro} = {n * micro} "
                          "(batch sizes are inconsistent with the spec)")
    cut = [isinstance(x, Tensor) and x.dim() > 0 for x in leaves]
    return [pytree.tree_unflatten([x.narrow(0, i * m, m) if c else x for x, c in zip(leaves, cut)], spec)
            for i in range(n)]


def on_device(batch: Any, device: torch.device) -> Any:
    """The batch's tensors on the compute device (as Hugging Face's Trainer and JAX's device_put
    do): a batch from a CPU data loader runs on the GPU; tensors already there are not copied."""
    if device.type == "cpu":
        return batch
    return pytree.tree_map(lambda x: x.to(device, non_blocking=True) if isinstance(x, Tensor) else x, batch)


def scalar_loss(loss: Any) -> Tensor:
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise ConfigError(f"loss_fn must return a scalar tensor; got {shape}. Reduce it (e.g. .mean()) in loss_fn")
    return loss.reshape(())
