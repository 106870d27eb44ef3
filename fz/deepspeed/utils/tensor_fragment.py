"""DeepSpeed's `safe_get_full_fp32_param`, `safe_get_full_optimizer_state`,
`safe_set_full_fp32_param` and `safe_get_full_grad` on a parameter of the engine's model.

DeepSpeed reads a parameter's fp32 master (or an Adam moment) whole from its partitions, and
writes one back, for a script that inspects or edits the training state by parameter. Here
the parameter names its place in the engine's State (its canonical name); each rank holds some
of its elements (`fz.ckpt.hf.pretrained._places`), and the whole is summed over the shard
group: a collective at every stage (every rank calls it, as DeepSpeed's at ZeRO-3). A write
reaches the fp32 master and the parameter the forward uses, the optimizer state kept; a NaN
or inf is refused. `safe_get_full_grad` reads the open step's gradients (fz/step/grad_views.py);
fz keeps none after its update.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import Shard

from fz.ckpt.deepspeed.importer import _moment_places
from fz.ckpt.hf.pretrained import _places, _put
from fz.deepspeed import model_sync, zero
from fz.distributed.arrival import arrive
from fz.errors import ConfigError
from fz.sharding.settle import Handle

_KINDS = ("exp_avg", "exp_avg_sq")


def _owner(param: Any, call: str) -> tuple[Any, str]:
    """(the engine training `param`, its canonical name in the engine's State)."""
    engines = zero._owners([param]) if isinstance(param, torch.nn.Parameter) else []
    if not engines:
        raise ConfigError(f"deepspeed.utils.{call}: the tensor given is not a parameter of a model "
                          "deepspeed.initialize was given")
    engine = engines[0]
    name = next(n for n, p in engine._model.named_parameters() if p is param)
    return engine, engine.state.skeleton.aliases.get(name, name)


def _whole(engine: Any, name: str, places: list[tuple[Tensor, int, int]], shape: torch.Size, master: bool,
           call: str) -> Tensor:
    """The full fp32 tensor from this rank's places of it, summed over the shard group where its
    bucket's `master`s (fp32 masters and moments) or parameters are sharded (the same on every
    rank: a replicated one is whole on each). Called by one rank alone, `call` fails in seconds."""
    out = torch.zeros(math.prod(shape), dtype=torch.float32, device=engine.state.plan.device)
    for view, lo, hi in places:
        out[lo:hi] = view[:hi - lo].float()
    plan = engine.state.plan
    bucket = plan.slots()[name][0]
    sharded = isinstance(bucket.place.opt, Shard) if master else bucket.sharded_param
    if sharded and plan.shards > 1:
        arrive(f"deepspeed.utils.{call}", plan.ranks, plan.rank)
        Handle([out]).add(dist.all_reduce(out, group=plan.shard_group, async_op=True)).wait()  # fz's deadline
    return out.view(shape)


def _master_places(engine: Any, name: str) -> tuple[list[tuple[Tensor, int, int]], bool]:
    """This rank's places of the fp32 master where there is one (mixed precision), else of the
    parameter; and which it is."""
    places = _places(engine.state).get(name, [])
    return places[-1:], len(places) > 1


def safe_get_full_fp32_param(param: Any) -> Tensor:
    """The parameter's fp32 master weights, whole (every rank calls it)."""
    engine, name = _owner(param, "safe_get_full_fp32_param")
    places, master = _master_places(engine, name)
    return _whole(engine, name, places, param.shape, master, "safe_get_full_fp32_param")


def safe_get_full_optimizer_state(param: Any, optim_state_key: str) -> Tensor | None:
    """Adam's `exp_avg` or `exp_avg_sq` of the parameter, whole; None where the optimizer keeps no
    such state (SGD, a frozen parameter). Every rank calls it."""
    engine, name = _owner(param, "safe_get_full_optimizer_state")
    if optim_state_key not in _KINDS:
        raise ConfigError(f"deepspeed.utils.safe_get_full_optimizer_state(param, {optim_state_key!r}): fz keeps "
                          f"{' and '.join(_KINDS)} (Adam's moments)")
    places = _moment_places(engine.state).get(optim_state_key, {}).get(name)
    return None if places is None else _whole(engine, name, places, param.shape, True,
                                              "safe_get_full_optimizer_state")


def safe_set_full_fp32_param(param: Any, value: Tensor) -> None:
    """The parameter's fp32 master (and the copy the forward uses) set to `value`, its optimizer
    state kept. Every rank calls it with the same value; not inside an accumulation window."""
    engine, name = _owner(param, "safe_set_full_fp32_param")
    if engine._step is not None:
        raise ConfigError("deepspeed.utils.safe_set_full_fp32_param inside an accumulation window: set it before "
                          "engine(batch), or after engine.step() at the boundary")
    value = torch.as_tensor(value)
    if tuple(value.shape) != tuple(param.shape):
        raise ConfigError(f"deepspeed.utils.safe_set_full_fp32_param: a value of shape {tuple(value.shape)} for "
                          f"{name} of shape {tuple(param.shape)}")
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise ConfigError(f"deepspeed.utils.safe_set_full_fp32_param: the value for {name} holds NaN or inf, which "
                          "would skip every later step")
    with torch.no_grad():
        _put(_places(engine.state).get(name, []), 0, value.reshape(-1).to(torch.float32))
    engine._synced_step = -1
    model_sync.pull(engine)  # the script's model holds the new weights too (every rank calls this)


def safe_get_full_grad(param: Any) -> Tensor | None:
    """The parameter's gradient so far in the open accumulation window (between engine.backward
    and the boundary's engine.step()), whole: its `.grad` where the model holds one, as DeepSpeed
    returns it, else gathered from the step's buffers in fp32 (every rank calls it); None outside a
    window, as fz keeps no gradient after its update."""
    engine, name = _owner(param, "safe_get_full_grad")
    if param.grad is not None:
        return param.grad
    if engine._step is None:
        return None
    if len(engine.state.plan.ranks) > 1:  # a collective where the gradients are reduced into shards
        arrive("deepspeed.utils.safe_get_full_grad", engine.state.plan.ranks, engine.state.plan.rank)
    return engine._step.whole_grad(name)
