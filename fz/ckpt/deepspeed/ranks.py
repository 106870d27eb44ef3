"""A DeepSpeed checkpoint's rank files must all be of one run: checked before their pieces are joined.

Each data-parallel rank writes its own optimizer-states file (and at ZeRO 3 its own model
states). A file of another run copied or renamed into the tag folder would otherwise be read
as this run's partition, silently. So each rank's file is compared with rank 0's on what one
run shares: DeepSpeed's version, the ZeRO stage and partition count, the partition layout
(every rank's partition of a group has one size, padding included) and Adam's step; ZeRO-3
model states on the parameter shapes and the global step. The first that differs is refused,
naming the file and what differs. (Two runs alike in all of these cannot be told apart.)
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from fz.ckpt.deepspeed import fields
from fz.ckpt.deepspeed import unpickle as ds_pickle
from fz.ckpt.deepspeed.unpickle import Lazy
from fz.errors import CheckpointError


def _number(x: Any) -> Any:
    """A scalar, whether stored as a number or a one-element tensor."""
    if isinstance(x, Lazy):
        return ds_pickle.materialize(x).item() if x.numel == 1 else x.shape
    return x


def _step(state: Any) -> Any:
    """Adam's step in the first group's state (every rank steps together), or None."""
    if isinstance(state, list):
        state = dict(enumerate(state))
    first = next(iter(state.values()), None) if isinstance(state, dict) else None
    return _number(first.get("step")) if isinstance(first, dict) else None


def optim(top: dict[str, Any], file: Path) -> dict[str, Any]:
    """{what one run's optimizer files share: its value in this file (`file`, named if a count is damaged)}."""
    osd = top["optimizer_state_dict"]
    stage = osd.get("zero_stage")
    if stage == 3:
        sizes: list[Any] = [t.numel for t in osd["fp32_flat_groups"]]
        state = osd["optimizer_state_dict"]["state"]
    else:
        groups = osd["single_partition_of_fp32_groups"]
        # ZeRO 1/2 cut the last rank's padding from its partition; BF16_Optimizer's: group count only
        sizes = ([t.numel + p for t, p in zip(groups, fields.paddings(osd.get("group_paddings"), len(groups), file))]
                 if stage is not None else [len(groups)])
        base = osd.get("base_optimizer_state")
        state = base.get("state") if isinstance(base, dict) else base
    return {"DeepSpeed version": top.get("ds_version"), "ZeRO stage": stage,
            "partition_count": osd.get("partition_count"), "partition sizes": sizes, "Adam step": _step(state)}


def model(m: dict[str, Any]) -> dict[str, Any]:
    """{what one run's model-states files share: its value in this file}."""
    return {"DeepSpeed version": m.get("ds_version"), "param_shapes": m.get("param_shapes"),
            "frozen_param_shapes": m.get("frozen_param_shapes"), "global_steps": m.get("global_steps")}


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 120 else text[:117] + "..."


def same_run(files: list[Path], signatures: list[dict[str, Any]]) -> None:
    """Refuse the first of `files` whose signature (optim/model) differs from the first file's
    on something both hold."""
    ref = signatures[0]
    for f, sig in zip(files[1:], signatures[1:]):
        for what, value in sig.items():
            if what in ref and value != ref[what]:
                raise CheckpointError(
                    f"DeepSpeed checkpoint file {f} is not of the run that wrote {files[0].name}: its {what} "
                    f"{_short(value)} differs from {files[0].name}'s {_short(ref[what])} (a file of another run "
                    f"copied or renamed into {f.parent}?): not read")
