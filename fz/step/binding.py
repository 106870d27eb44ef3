"""Giving a block its tensors for a step, so that a checkpoint *inside* the block can recompute it.

`torch.func.functional_call` swaps the tensors in for the call and back out at its end: a
`torch.utils.checkpoint` inside the block (Hugging Face's gradient checkpointing, or the
user's own) recomputes in backward, after the swap back, and meets fz's meta tensors. So
fz binds a block's tensors into its (fz-owned, meta) skeleton module and leaves them
bound until the step's backward is done (`Bindings.release`). For replicated buckets
these are views of the step's storage (no memory). A stage-3 block's gathered tensors are
unbound right after its forward, so that they die with it, unless a checkpoint ran inside
it (`checkpoint_seen`): then they stay bound for the recompute, as the checkpoint needs.

`checkpoint_seen` wraps torch.utils.checkpoint's two entry points once (module globals that
`checkpoint()` looks up at each call; which global is torch's choice: fz/compat.py) so that a
checkpoint started inside a block marks it.
"""
from __future__ import annotations

import contextvars
from typing import Any

import torch.nn as nn
from torch import Tensor

from fz.compat import checkpoint_generator_name

_SEEN: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar("fz_checkpoint_seen", default=None)
_INSIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("fz_inside_checkpoint", default=False)


def inside_checkpoint() -> bool:
    """Whether a torch.utils.checkpoint (non-reentrant) is running its forward here: the tensors
    saved now are the checkpoint's to drop and recompute."""
    return _INSIDE.get()
_Slot = tuple[dict[str, Any], str, Any]  # (module._parameters or _buffers, key, the meta tensor it held)


def _mark() -> None:
    seen = _SEEN.get()
    if seen is not None:
        seen[0] = True


def _install() -> None:
    import torch.utils.checkpoint as cp
    if getattr(cp, "_fz_marks_blocks", False):
        return
    gen_name = checkpoint_generator_name()
    plain_gen, plain_fn = getattr(cp, gen_name), cp.CheckpointFunction

    def generator(*args: Any, **kwargs: Any):
        _mark()
        token = _INSIDE.set(True)
        try:
            return (yield from plain_gen(*args, **kwargs))
        finally:
            _INSIDE.reset(token)

    class CheckpointFunction(plain_fn):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx, run_function, preserve_rng_state, *args):
            _mark()
            return plain_fn.forward(ctx, run_function, preserve_rng_state, *args)

    patched: Any = cp  # module attributes replaced: no static type says they may be
    setattr(patched, gen_name, generator)
    patched.CheckpointFunction = CheckpointFunction
    patched._fz_marks_blocks = True


class checkpoint_seen:
    """Context: `seen[0]` becomes True if a torch.utils.checkpoint starts inside it."""

    def __enter__(self) -> list[bool]:
        _install()
        self.seen = [False]
        self.token = _SEEN.set(self.seen)
        return self.seen

    def __exit__(self, *exc: Any) -> None:
        _SEEN.reset(self.token)


class Bindings:
    """Tensors bound into skeleton modules, and the meta tensors to put back."""

    def __init__(self) -> None:
        self.slots: list[_Slot] = []

    def bind(self, module: nn.Module, tensors: dict[str, Tensor]) -> list[_Slot]:
        """Put `tensors` ({dotted name inside `module`: tensor}) into `module`; returns their slots."""
        slots: list[_Slot] = []
        for name, t in tensors.items():
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            table: dict[str, Any] = owner._parameters if leaf in owner._parameters else owner._buffers  # any tensor
            if leaf in table:
                slots.append((table, leaf, table[leaf]))
                table[leaf] = t
        self.slots.extend(slots)
        return slots

    @staticmethod
    def unbind(slots: list[_Slot]) -> None:
        for table, leaf, meta in reversed(slots):
            table[leaf] = meta

    def release(self) -> None:
        """Every skeleton module back to its meta tensors (after backward)."""
        self.unbind(self.slots)
        self.slots = []
