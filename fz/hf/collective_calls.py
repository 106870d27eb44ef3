"""Trainer calls every rank must make (`evaluate`, `predict`, `save_model`): each gathers from or
averages over every rank, so one made on one rank alone fails in seconds, naming the call and
the fix, instead of hanging."""
from __future__ import annotations

import fz
from fz.errors import ConfigError


def check_in(state: fz.State, call: str) -> None:
    """Return once every rank of `state` made `call`; a ConfigError naming it if one did not."""
    if len(state.plan.ranks) == 1:
        return
    try:
        fz.distributed.arrive(f"trainer.{call}()", state.plan.ranks, state.plan.rank)
    except ConfigError as e:  # transformers' idiom for "on one rank", and why it is not needed here
        raise ConfigError(str(e).replace(
            "not under `if rank == 0:`", "not under `if trainer.is_world_process_zero():` (fz.hf writes files "
            "on rank 0 only, and gathers the weights from every rank)")) from None
