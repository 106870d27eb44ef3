"""What transformers' Trainer counts of a step before its forwards, with fz's sums over ranks.

transformers counts `num_items_in_batch` (the label tokens the loss divides by) and the input
tokens seen on each rank and sums them with accelerate's `gather`, a collective with no
deadline of fz's. Here its own count runs on this rank's micro-batches and `fz.sum_over_ranks`
sums it (bounded by Spec.timeout_s; a lost rank is an fz.PeerError).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import fz


def num_items(trainer: Any, batches: Iterable[Any]) -> Any:
    """transformers' `num_items_in_batch` of a step's micro-batches, or of one evaluation batch
    (None: the loss is a per-batch mean). Every rank calls it (the sum over ranks)."""
    args = trainer.args
    across = bool(getattr(args, "average_tokens_across_devices", False))
    args.average_tokens_across_devices = False  # transformers' count on this rank alone; summed below
    try:
        items = trainer._get_num_items_in_batch(list(batches), args.device)
    finally:
        args.average_tokens_across_devices = across
    if items is not None and across and args.world_size > 1:
        items = fz.sum_over_ranks(trainer.fz_ready(), items)
    return items


def track_input_tokens(trainer: Any, batches: fz.MicroBatches) -> None:
    """`state.num_input_tokens_seen`, as transformers' _track_num_input_tokens counts it."""
    how = getattr(trainer.args, "include_num_input_tokens_seen", "no")
    if how in ("no", False, None):
        return
    count = sum(_input_tokens(trainer, mb, how) for mb in batches)
    trainer.state.num_input_tokens_seen += int(fz.sum_over_ranks(trainer.fz_ready(), count))


def _input_tokens(trainer: Any, inputs: Any, how: str) -> int:
    name = getattr(trainer.model, "main_input_name", "input_ids")
    if name not in inputs:
        return 0
    if how == "non_padding" and "attention_mask" in inputs:
        return int(inputs["attention_mask"].sum())
    pad = getattr(trainer.processing_class, "pad_token_id", None)
    if how == "non_padding" and pad is not None:
        return int((inputs[name] != pad).sum())
    return int(inputs[name].numel())
