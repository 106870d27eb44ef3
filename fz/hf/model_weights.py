"""`trainer.model`'s weights while train() runs: the State's, never a second copy.

fz trains a skeleton of the model whose tensors are the State's. `trainer.model`'s own
parameters would stay a second whole copy on every rank (at ZeRO-3 more than the rank's share of
the State itself), and a stale one: training never updates them. So while train() runs, each
parameter of `trainer.model` (a frozen PEFT base too) is let go: it keeps its identity, shape,
attributes and ties, and its own storage is freed. At ZeRO 0-2, where every rank holds every
parameter whole, it becomes a view of the State's copy (the one the forward computes with, in
its dtype: a bf16 run's bf16, as DeepSpeed's module is at those stages), so a callback that
reads the model (TRL's BEMACallback, an EMA) reads each update's weights, for free (`follow`
keeps it so). At ZeRO-3 (or on the disk tier) it is on the meta device, as DeepSpeed's
partitioned parameters hold nothing. A call of the model runs on the State meanwhile
(fz/hf/model_calls.py). The model's own weights, in its dtype, come back from the State (the
fp32 masters where there are), one bucket gathered at a time: at the end of train(), on the
trainer's device (where transformers places the model; at ZeRO-3 where the model was: a model
larger than one device is never whole on one), and around an online trainer's generation, on
the trainer's device (fz/hf/online.py). Every rank calls `fill` (it may gather).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
from torch import nn

import fz
from fz.errors import ConfigError, PeerError
from fz.observe.full_params import copy_full_params, local_param_views

log = logging.getLogger(__name__)


class Given(NamedTuple):
    """Where a parameter let go comes back, and in which dtype (its own)."""
    device: torch.device
    dtype: torch.dtype


Released = dict[str, Given]  # the parameters let go, by name
_OWN = ("transformers.", "fz.")  # callbacks that read no parameter (logging, progress, flow)


def _swap(p: nn.Parameter, storage: torch.Tensor) -> None:
    """`p` itself (its identity, attributes and ties kept) holding `storage` (meta: nothing)."""
    other = nn.Parameter(storage, requires_grad=p.requires_grad)
    other.__dict__.update(p.__dict__)
    try:
        torch.utils.swap_tensors(p, other)
    except RuntimeError:  # a weak reference to it (a callback's): its data, as Module._apply sets it
        p.data = storage


def _nothing(p: nn.Parameter) -> torch.Tensor:
    return torch.empty(p.shape, dtype=p.dtype, device="meta")


def upcast(model: nn.Module) -> Released:
    """A model loaded in bf16 or fp16 (`dtype=torch.bfloat16`, a LoRA's half-precision base) with
    its floating parameters made fp32 in place, fz's masters made from those values as DeepSpeed
    makes its own; the record of each (its device, its own dtype) to give it back in after train()."""
    out: Released = {}
    for name, p in model.named_parameters():  # a tied parameter once
        if p.is_floating_point() and p.dtype != torch.float32 and not p.is_meta:
            out[name] = Given(p.device, p.dtype)
            _swap(p, p.detach().float())
    if out:
        dtypes = sorted({str(g.dtype).removeprefix("torch.") for g in out.values()})
        log.warning("fz.hf: trainer.model's parameters are %s (%d of them): fz trains fp32 masters made from "
                    "their values, as DeepSpeed does, in the run's precision (an fp32 run computes in fp32, where "
                    "DeepSpeed computes with the half-precision values it keeps: bf16=True gives its arithmetic "
                    "and memory), and gives them back in their own dtype after train()", "/".join(dtypes), len(out))
    return out


def loaded_half(model: nn.Module, released: Released) -> torch.dtype | None:
    """The half dtype every floating parameter of `model` was loaded in (`upcast`'s records for the
    ones let go), or None: a model loaded wholly in bf16 (fp16)."""
    dtypes = {released[n].dtype if n in released else p.dtype for n, p in model.named_parameters()
              if p.is_floating_point()}
    one = next(iter(dtypes)) if len(dtypes) == 1 else None
    return one if one in (torch.bfloat16, torch.float16) else None


def let_go(model: nn.Module, device: torch.device | None, state: fz.State) -> Released:
    """Each parameter's own storage freed: a view of the State's where there is one (ZeRO 0-2),
    else on the meta device; it comes back on `device` (None: the device it was on)."""
    views = local_param_views(state) or {}
    out: Released = {}
    for name, p in model.named_parameters():  # a tied parameter once
        view = views.get(name)
        if p.is_meta or (view is not None and p.data_ptr() == view.data_ptr()):
            continue  # let go already
        given = Given(device if device is not None else p.device, p.dtype)
        try:
            _swap(p, view if view is not None and view.shape == p.shape else _nothing(p))
        except RuntimeError as e:  # something holds on to it (an autograd graph kept alive)
            log.warning("fz.hf: trainer.model keeps its own copy of %s (%s): it cannot be let go while train() "
                        "runs", name, e)
            continue
        out[name] = given
    return out


def follow(model: nn.Module, state: fz.State, released: Released, callbacks: Iterable[object]) -> None:
    """After a step: each parameter held as a view of the State reads this update's weights (a State
    whose storage moved gets new views). Where a callback may read them (any but transformers' and
    fz's own), the parameters' gather in flight (ZeRO 1-2) is finished now, else the next forward's."""
    views = local_param_views(state, settle=any(not type(c).__module__.startswith(_OWN) for c in callbacks))
    if not views:
        return
    own = dict(model.named_parameters())
    for name in released:
        view, p = views.get(name), own[name]
        if view is not None and not p.is_meta and p.data_ptr() != view.data_ptr():
            try:
                _swap(p, view)
            except RuntimeError as e:  # something holds on to it: it keeps the last update's values
                log.warning("fz.hf: trainer.model's %s cannot follow the State (%s): it holds an earlier update's "
                            "weights", name, e)


def fill(model: nn.Module, state: fz.State, released: Released, cast: torch.dtype | None = None) -> None:
    """The State's weights in `model` (in its dtype; then its parameters cast to `cast`, if given, as
    DeepSpeed 0.19 casts its module's, its buffers kept), the parameters let go given storage of
    their own again on their devices first (at ZeRO 0-2, a trained one a view of the State's own where
    dtype and device agree, as DeepSpeed's module shares its engine's: no second copy), and its buffers moved
    there; if the copy fails they are let go again as they were. A collective: every rank calls it."""
    own = dict(model.named_parameters())
    before = {n: own[n].data for n in released}
    given: list[str] = []
    stuck: dict[str, str] = {}
    views = local_param_views(state) or {}  # ZeRO 0-2: the State's own storage, as DeepSpeed's module holds it
    viewed = []
    try:
        for name, (device, dtype) in released.items():
            view = views.get(name) if own[name].requires_grad else None  # a frozen one (a PEFT base) is its
            # own: PEFT's merge writes into it in place, and fz's forward would add the adapter once more
            if view is not None and view.dtype == (cast or dtype) and view.device == torch.device(device):
                _swap(own[name], view)  # no second copy of the weights
                viewed.append(name)
                continue
            try:
                _swap(own[name], torch.empty(own[name].shape, dtype=dtype, device=device))
            except RuntimeError as e:  # a weak reference to a parameter on meta: it cannot have storage again
                stuck[name] = str(e)
                continue
            given.append(name)
        # nothing given storage: every parameter let go is a view (those already viewing the State were not let go)
        done = copy_full_params(state, model) if given else {id(own[n]) for n in viewed}
        missing = [n for n in given if id(own[n]) not in done]
        if missing:
            raise ConfigError(f"fz.hf: the State holds no values for trainer.model's {missing[:5]}: they cannot be "
                              "filled in after training")
    except BaseException:
        for name in given + viewed:  # never storage that holds no weights: each as it was
            _swap(own[name], before[name])
        raise
    if stuck:
        log.warning("fz.hf: trainer.model's %s cannot hold the trained weights (%s): something keeps a weak "
                    "reference to them; they stay as they were while training, and fz.full_params(trainer.fz_state) "
                    "has their values", list(stuck)[:5], next(iter(stuck.values())))
    for device in {g.device for g in released.values()}:  # one: the trainer's device, or where the model was
        if not stuck:
            model.to(device)
            continue
        for module in model.modules():  # the buffers alone: a parameter left on meta cannot move
            for key, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[key] = buf.to(device)
    if cast is not None and not stuck:  # the parameters only: buffers keep their dtype (RoPE's fp32 inv_freq)
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != cast:
                p.data = p.data.to(cast)


def fill_after_error(fill_in: Callable[[], None]) -> None:
    """train() raised while the State held `trainer.model`'s weights: `fill_in` puts them back
    where that still works (every rank raised and gathers; one rank holds them all); where it does
    not (a rank still in a step cannot join the gather) the model stays on meta, and the warning
    says where the weights are. The train() error is what is raised either way."""
    try:
        fill_in()
    except Exception as e:  # noqa: BLE001 - the train() error is the one raised
        keep = ("this process's State is unusable: restart from the last checkpoint" if isinstance(e, PeerError)
                else "trainer.fz_state holds them as of the failure: fz.save(trainer.fz_state, dir) on every rank "
                "keeps them")
        log.warning("fz.hf: train() failed, and trainer.model's weights could not be filled back in from "
                    "trainer.fz_state (%s: %s): its parameters stay as they were while training (views of the "
                    "State's copy at ZeRO 0-2, on the meta device at ZeRO-3); %s", type(e).__name__, str(e)[:300], keep)
