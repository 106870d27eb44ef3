"""`trainer.model.device` while train() runs at ZeRO-3: the trainer's device, not meta.

At ZeRO-3 `trainer.model`'s parameters are on the meta device while train() runs (the State
holds their shards: fz/hf/model_weights.py), so transformers' `model.device` (its first
parameter's) would say meta, and a callback placing its inputs there (`.to(model.device)`,
TRL's LogCompletionsCallback before it generates) would lose them. DeepSpeed's partitioned
parameters are empty tensors that keep their device, so there `model.device` names the
engine's. Here each module of the model whose class has transformers' `device` property is
given, for the run, a subclass of its own class (same name, module and qualified name) whose
`device` is the trainer's, and whose `save_pretrained` says to call `trainer.save_model` (the
model holds no weights to write); its class comes back when the weights do.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from fz.errors import ConfigError

_SUBCLASSES: dict[tuple[type, torch.device], type] = {}
_SHOWN: weakref.WeakKeyDictionary[nn.Module, type] = weakref.WeakKeyDictionary()  # module -> its own class


def _not_while_sharded(self: Any, *args: Any, **kwargs: Any) -> Any:
    """Its own class's save_pretrained where the module holds its weights (a filled copy: a merged
    adapter's); else the way to save."""
    if not any(p.is_meta for p in self.parameters()):
        return super(type(self), self).save_pretrained(*args, **kwargs)
    raise ConfigError(f"{type(self).__name__}.save_pretrained() while train() runs at ZeRO-3: the model's weights "
                      "are the State's shards (trainer.fz_state), not in the model, which would be written empty "
                      "(as transformers writes DeepSpeed ZeRO-3's empty partitions). Call trainer.save_model(dir) on "
                      "every rank")


def _showing(cls: type, device: torch.device) -> type:
    key = (cls, device)
    if key not in _SUBCLASSES:
        body: dict[str, Any] = {
            "device": property(lambda self: device, doc="The trainer's device (fz/hf/model_device.py)."),
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "_fz_shows_device": True}
        if hasattr(cls, "save_pretrained"):  # its meta tensors: a raw "Cannot copy out of meta tensor"
            body["save_pretrained"] = _not_while_sharded
        _SUBCLASSES[key] = type(cls.__name__, (cls,), body)
    return _SUBCLASSES[key]


def show(model: nn.Module, device: torch.device) -> None:
    """While `model`'s parameters are on meta: its modules' `device` is `device`."""
    if not any(p.is_meta for p in model.parameters()):
        return
    for module in model.modules():
        cls = type(module)
        if module in _SHOWN or not isinstance(getattr(cls, "device", None), property):
            continue
        _SHOWN[module] = cls
        module.__class__ = _showing(cls, torch.device(device))


def unshow(model: nn.Module) -> None:
    """Each module's own class back."""
    for module in model.modules():
        own: Any = _SHOWN.pop(module, None)
        if own is not None:
            module.__class__ = own
