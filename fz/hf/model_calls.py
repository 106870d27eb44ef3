"""`trainer.model` called directly while the fz State holds its weights, or before fz placed it.

transformers places the whole model on the device when a Trainer is made; under DeepSpeed it does
not (DeepSpeed shards the model from where it is), and under fz neither
(`place_model_on_device` is False): a model larger than one device is never whole on one. While
train() runs every parameter of `trainer.model` is let go (fz/hf/model_weights.py): the State holds
them.

TRL calls the trained model itself, not compute_loss's `model`: the reference forward of a PEFT
policy with its adapter disabled (DPO, KTO), reference log-probabilities precomputed as the
trainer is made. Under DeepSpeed ZeRO-3 that call gathers through the hooks on the module. Here,
while the weights are let go, `trainer.model.forward` is a `StateForward`: inside a training step
it runs on that step's forward (its gathered blocks, its mode), elsewhere through `fz.apply` (at
ZeRO-3 a collective, as DeepSpeed's is), with the flags a library keeps on the model's modules
(PEFT's disabled or active adapter, a dropout's `p`) carried onto fz's skeleton for the call.
Before any weight is let go, the first call places the model where transformers would have put
it at construction (`PlaceFirst`), and runs its own forward. A model TRL prepares for inference (a
reference model, a distillation teacher: `accelerator.prepare_model(m, evaluation_mode=True)`,
where DeepSpeed would shard it) is not placed either (`unplaced_second_models`): fz shards it
into an inference State when the trainer first needs one; a call before that places it first.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import inspect
import logging
from collections.abc import Iterator
from typing import Any

from torch import nn

import fz
from fz.errors import ConfigError
from fz.hf import added_hooks, model_device
from fz.hf.added_hooks import flag, skeleton_modules
from fz.model.skeleton import Skeleton
from fz.rng import capture

log = logging.getLogger(__name__)
_FZ_SETS = ("training", "gradient_checkpointing")  # fz's own choices on its copy (mode; it checkpoints itself)
_STEP: contextvars.ContextVar[Any] = contextvars.ContextVar("fz_hf_step_model", default=None)


@contextlib.contextmanager
def flags_mirrored(model: nn.Module, skel: Skeleton) -> Iterator[None]:
    """The skeleton's modules with `model`'s module flags (not their mode, nor fz's own), put back after."""
    theirs = dict(model.named_modules())
    changed: list[tuple[nn.Module, str, Any]] = []
    missing = object()
    for name, mine in skeleton_modules(skel).items():
        other = theirs.get(name)
        if other is None:
            continue
        for key, value in vars(other).items():
            if key in _FZ_SETS or key.startswith("_fz") or not flag(value):
                continue
            old = mine.__dict__.get(key, missing)
            if old is not missing and (not flag(old) or old == value):
                continue
            changed.append((mine, key, old))
            mine.__dict__[key] = value
    try:
        yield
    finally:
        for mine, key, old in reversed(changed):
            if old is missing:
                del mine.__dict__[key]
            else:
                mine.__dict__[key] = old


class StateForward:
    """While the State holds the weights, `model.forward` (an instance attribute): the call runs
    on the State (see the module docstring). It has the forward's signature: transformers and TRL
    read the columns and keyword arguments a model takes from it. A library may wrap it in turn
    (TRL's fused LM head keeps the forward it found): once removed it passes calls on to the
    forward it replaced."""

    name = "forward"  # the method it stands in for

    def __init__(self, trainer: Any, model: nn.Module):
        self.trainer, self.model, self.active = trainer, model, True
        self.replaced = model.__dict__.get(self.name)  # an instance one already there (a library's patch)
        self.own = getattr(model, self.name)
        self.__self__ = model  # a copy of the model (fz's skeleton) that calls it calls its own (fz/model/skeleton.py)
        functools.update_wrapper(self, self.own)  # a callable object, as a function
        self.__signature__ = inspect.signature(self.own)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A copy of the model (fz's skeleton) gets the model's own forward, bound to the copy."""
        return copy.deepcopy(self.own, memo)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active:
            return self.own(*args, **kwargs)
        trainer = self.trainer
        state = trainer.fz_ready()
        with flags_mirrored(self.model, state.skeleton):
            bound = _STEP.get()
            if bound is not None:  # inside the step's loss: on the step's own forward
                return bound(*args, **kwargs)
            try:
                return fz.apply(state, *args, train=self.model.training, **kwargs)
            except ConfigError as e:  # made on one rank (a callback's sample under `if rank == 0:`)
                if "every rank must call" not in str(e):
                    raise
                raise ConfigError(f"trainer.model called while train() runs: its weights are the State's, sharded "
                                  f"over the ranks (ZeRO-3), so the call gathers them on every rank, as under "
                                  f"DeepSpeed ZeRO-3: make it on every rank (generate on each, print on one). {e}"
                                  ) from None

    def remove(self) -> None:
        self.active = False
        if self.model.__dict__.get(self.name) is not self:
            log.debug("fz.hf: trainer.model.%s was replaced again since fz set it; left as it is", self.name)
            return
        if self.replaced is None:
            del self.model.__dict__[self.name]
        else:
            self.model.__dict__[self.name] = self.replaced


class PlaceFirst:
    """A forward pre-hook: before the model's first call, the model goes where transformers would
    have put it when the Trainer was made (the trainer's device), and the hook goes. (A hook, not
    a forward: libraries wrap a model's forward in closures, accelerate's autocast among them.) A
    copy of the model gets one that does nothing."""

    def __init__(self, device: Any = None, what: str = ""):
        self.device, self.what = device, what
        self.handle: Any = None

    def __call__(self, module: nn.Module, args: Any) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        if self.device is not None and any(p.device != self.device for p in module.parameters() if not p.is_meta):
            log.info("fz.hf: %s was called before fz sharded it: it is placed on %s", self.what, self.device)
            module.to(self.device)

    def __reduce__(self) -> tuple[Any, ...]:
        return PlaceFirst, ()

    def __deepcopy__(self, memo: dict[int, Any]) -> PlaceFirst:
        return PlaceFirst()


def place_first(trainer: Any, model: nn.Module | None, what: str = "trainer.model") -> None:
    """`model` placed on the trainer's device before its first call (`PlaceFirst`), once."""
    if model is None or any(isinstance(h, PlaceFirst) for h in model._forward_pre_hooks.values()):
        return
    hook = PlaceFirst(trainer.args.device, what)
    hook.handle = model.register_forward_pre_hook(hook)


def not_placing(model: nn.Module) -> None:
    """`place_first`'s hook taken away (the model's weights are the State's now)."""
    for key, h in list(model._forward_pre_hooks.items()):
        if isinstance(h, PlaceFirst):
            del model._forward_pre_hooks[key]


@contextlib.contextmanager
def in_step(model: Any) -> Iterator[None]:
    """While a step's loss runs: `model` (compute_loss's) is what a call of `trainer.model` runs on."""
    token = _STEP.set(model)
    try:
        yield
    finally:
        _STEP.reset(token)


class SyncedGenerate(StateForward):
    """While the State holds the weights (ZeRO-3), `model.generate`. Sharded over several ranks:
    `synced_gpus=True` unless the call says otherwise, as transformers sets it under DeepSpeed
    ZeRO-3. Each forward gathers on every rank, so a rank whose sequences ended keeps stepping
    until every rank's have (its own generate otherwise stops calling, and the others wait).
    An encoder-decoder's (Seq2SeqTrainer's predict_with_generate): HF's generate calls the
    encoder itself, outside the forward fz stands in for, so while its weights are let go the
    call is fz.generate on the State, drawing from the process's generator as transformers'."""

    name = "generate"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active:
            return self.own(*args, **kwargs)
        state = self.trainer.fz_ready()
        if getattr(getattr(self.model, "config", None), "is_encoder_decoder", False) and \
                any(p.is_meta for p in self.model.parameters()):
            kwargs.pop("synced_gpus", None)  # fz.generate keeps the ranks in lockstep itself
            with flags_mirrored(self.model, state.skeleton):
                return fz.generate(state.replace(rng=capture(state.plan.device)), *args, **kwargs)
        if any(b.sharded_param for b in state.plan.buckets) and len(state.plan.ranks) > 1:
            kwargs.setdefault("synced_gpus", True)
        return self.own(*args, **kwargs)


def install(trainer: Any, model: nn.Module) -> None:
    """A `StateForward` as `model.forward` (once), its first-call placement gone; at ZeRO-3 a
    `SyncedGenerate` as `model.generate`."""
    not_placing(model)
    added_hooks.mirror(model, trainer.fz_ready().skeleton)  # NEFTune's, added as train() starts
    model_device.show(model, trainer.args.device)  # at ZeRO-3, not meta
    if not isinstance(model.__dict__.get("forward"), StateForward):
        model.__dict__["forward"] = StateForward(trainer, model)
    if trainer.fz_ready().spec.stage == 3 and callable(getattr(model, "generate", None)) and \
            not isinstance(model.__dict__.get("generate"), SyncedGenerate):
        model.__dict__["generate"] = SyncedGenerate(trainer, model)


def follow_hooks(trainer: Any) -> None:
    """Before a step: hooks added to (or taken off) the model since they were mirrored onto fz's
    copy, mirrored anew (fz/hf/added_hooks.py)."""
    added_hooks.follow(trainer._model(), trainer.fz_ready().skeleton)


def uninstall(model: nn.Module) -> None:
    """The model's forward (and generate) as they were before fz set them, its hooks off fz's copy."""
    added_hooks.unmirror(model)
    model_device.unshow(model)
    for name in ("forward", "generate"):
        current = model.__dict__.get(name)
        if isinstance(current, StateForward):
            current.remove()


def end_neftune(trainer: Any) -> None:
    """At the end of train(), NEFTune's hook off the model and off fz's copy (which has it too when
    the State was made inside train(), after transformers added it), as transformers takes it off."""
    handle = getattr(trainer, "neftune_hook_handle", None)
    if handle is None:
        return
    if trainer.fz_state is not None:
        for module in skeleton_modules(trainer.fz_state.skeleton).values():
            if module._forward_hooks.pop(handle.id, None) is not None:
                module.__dict__.pop("neftune_noise_alpha", None)
    from transformers.integrations.neftune import deactivate_neftune

    deactivate_neftune(trainer.model, handle, trainer.accelerator)
    trainer.neftune_hook_handle = None


def not_placed(trainer: Any) -> None:
    """Neither `trainer.model` nor the models TRL prepares for inference are placed whole on the
    device; each goes there on its first call, if any comes before fz shards it."""
    place_first(trainer, trainer.model)
    unplaced_second_models(trainer)


def unplaced_second_models(trainer: Any) -> None:
    """`trainer.accelerator.prepare_model(m, evaluation_mode=True)` (TRL's for a reference model
    or teacher) leaves `m` where it is (`place_first`), instead of putting it whole on the device."""
    accelerator = trainer.accelerator
    prepare = accelerator.prepare_model

    def prepare_model(model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False) -> Any:
        if not evaluation_mode or device_placement is not None:  # asked for (TRL's reward models): as asked
            return prepare(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        place_first(trainer, model, "a model the trainer prepared for inference (a reference, a teacher)")
        return prepare(model, device_placement=False, evaluation_mode=True)

    accelerator.prepare_model = prepare_model
