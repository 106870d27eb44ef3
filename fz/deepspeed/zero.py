"""`deepspeed.zero` on fz: `Init` and `GatheredParameters`, as DeepSpeed scripts call them.

DeepSpeed's `zero.Init()` partitions each parameter as the model is built, and
`GatheredParameters(params)` gathers partitioned ones for a block of code. fz shards a model
when `deepspeed.initialize` makes its State, and the model object keeps whole parameters:
so `Init` builds the model as torch does (the same initial values as DeepSpeed's in fp32, drawn
from the same generator; under bf16 DeepSpeed's draws bf16 weights directly), saying once that
it is built whole; `GatheredParameters` brings the engine's current weights into the model's
parameters (every rank calls it, as in DeepSpeed).
Changing parameters inside it (`modifier_rank=`) reaches the training only before
`deepspeed.initialize`; after it, fz refuses rather than dropping the change.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from fz.errors import ConfigError

log = logging.getLogger(__name__)
_ENGINES: weakref.WeakSet[Any] = weakref.WeakSet()  # engines made by deepspeed.initialize in this process
_said = False


def register(engine: Any) -> None:
    _ENGINES.add(engine)


class Init(contextlib.ContextDecorator):
    """DeepSpeed's `zero.Init(...)`: the model is built whole here (its arguments have no effect)
    and sharded by deepspeed.initialize. For a model bigger than host memory, build it under
    `torch.device("meta")`: fz.init then materialises each rank's shard only."""

    def __init__(self, *args: Any, enabled: bool = True, **kwargs: Any):
        self.enabled = enabled

    def __enter__(self) -> Init:
        global _said
        if self.enabled and not _said:
            _said = True
            log.warning("deepspeed.zero.Init on fz: the model is built whole on this rank and sharded at "
                        "deepspeed.initialize; for a model bigger than host memory build it under "
                        "torch.device('meta') (fz.init materialises each rank's shard only)")
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _owners(params: list[torch.nn.Parameter]) -> list[Any]:
    ids = {id(p) for p in params}
    return [e for e in list(_ENGINES) if any(id(p) in ids for p in e._model.parameters())]


@contextlib.contextmanager
def GatheredParameters(params: Any, modifier_rank: int | None = None, fwd_module: Any = None,  # noqa: N802
                       enabled: bool = True) -> Iterator[None]:
    """The parameters hold the engine's current weights inside the block (every rank enters it)."""
    if not enabled:
        yield
        return
    listed = [params] if isinstance(params, torch.nn.Parameter) else list(params or [])
    owners = _owners(listed)
    for engine in owners:
        engine.module  # noqa: B018 - reading it copies the current weights in (gathered at stage 3)
    before = [p.detach().clone() for p in listed] if modifier_rank is not None and owners else None
    yield
    if before is not None and any(not torch.equal(b, p.detach()) for b, p in zip(before, listed)):
        raise ConfigError("deepspeed.zero.GatheredParameters(modifier_rank=...): parameters changed after "
                          "deepspeed.initialize do not reach fz's State (it holds the weights the engine trains); "
                          "change them before initialize, or load new weights with fz.load_weights(engine.state, "
                          "path)")

