"""A forward put in the place of a module standing for an fz State: run as that module's forward.

TRL's trainers reroute a method through a model's call (`_ForwardRedirection`, from Lightning):
`model.forward = f; model(...)` runs `f` in the forward's place, so that a wrapper (DDP, FSDP,
DeepSpeed's ZeRO-3 engine) makes the model's weights ready around it; `f` then reads the model
(`model.base_model(...)`, `model.get_output_embeddings().weight`). The modules fz.hf puts where
a trainer holds a model (the evaluated model, an inference-only second model) take it so: `f`
runs with the State's root tensors bound in fz's copy of the model, its blocks gathering as they
are called, and the module's attributes read from that copy while it runs (the training step's
own model, `BoundModel`, does the same in fz/step/runner.py).
"""
from __future__ import annotations

from typing import Any

from torch import nn

import fz
from fz.step.train import apply_call


class Inside:
    """The module as a redirected `f` is handed it: fz's copy of the model, its tensors bound; it
    passes `isinstance` checks as the model's class (TRL reads a PEFT student's backbone so)."""

    def __init__(self, root: nn.Module):
        self.__dict__["_root"] = root

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_root"], name)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return type(self.__dict__["_root"])


class RunsRedirected(nn.Module):
    """The mixin: `__call__` runs a forward put in the place of the own one on the State
    (`_redirect_state`); `_inside()` is fz's copy of the model while it runs, else None."""

    def _redirect_state(self) -> fz.State:
        raise NotImplementedError

    def _redirect_train(self) -> bool:
        """Whether the call runs in train mode (dropout): the module's."""
        return self.training

    def _after_redirected(self, state: fz.State) -> None:
        """Still inside the call, after `f` returned (the tensors are bound)."""

    def _inside(self) -> nn.Module | None:
        return self.__dict__.get("_fz_inside")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        patched = self.__dict__.get("forward")
        if patched is None or getattr(patched, "__self__", None) is self:
            self.__dict__.pop("forward", None)  # the own forward, put back by who replaced it
            return super().__call__(*args, **kwargs)
        state = self._redirect_state()

        def redirected(*a: Any, **k: Any) -> Any:
            root = state.skeleton.root
            self.__dict__["_fz_inside"] = root
            seen = Inside(root)  # the module handed to `f` (TRL's `unwrapped_model`), as fz's copy
            a = tuple(seen if x is self else x for x in a)
            k = {n: seen if x is self else x for n, x in k.items()}
            try:
                out = patched(*a, **k)
                self._after_redirected(state)
            finally:
                self.__dict__["_fz_inside"] = None
            return out

        return apply_call(state, redirected, *args, train=self._redirect_train(), **kwargs)
