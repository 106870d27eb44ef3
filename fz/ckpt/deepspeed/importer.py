"""`fz.import_deepspeed`: a DeepSpeed checkpoint (stage 0-3, fp32/fp16/bf16, or universal) into a state.

The checkpoint is read by `DeepSpeedCheckpoint` (fz/ckpt/deepspeed/checkpoint.py: its pickles parsed
without running code) one parameter at a time, each rank reading only the elements it holds,
in bounded chunks, straight into the tier the state keeps them in (fz/ckpt/hf/pretrained.py's
places). So memory is bounded by a chunk, never the model, and the checkpoint restores into
any fz stage and world size. What comes across:
- the fp32 master weights (and the compute-dtype parameters cast from them);
- Adam's moments (`exp_avg`, `exp_avg_sq` -> the state's `mu`, `nu`) and its step, which
  every count of the fz optimizer takes (so the lr schedule resumes where it was);
- the step (global_steps), the skipped-step count, fp16's loss scale and the buffers;
- client_state, returned beside the state.
"""
from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from fz.ckpt.finite import Counts, report
from fz.ckpt.hf.pretrained import Place, _narrowest, _places, _put, _see, _span
from fz.errors import CheckpointError
from fz.state import State, block_until_ready, expect_state

log = logging.getLogger(__name__)

_MOMENTS = {"exp_avg": "mu", "exp_avg_sq": "nu"}


def _walk(tree: Any) -> Iterator[Any]:
    """Every node of an optimizer state (tuples, named tuples, lists, dicts), parents first."""
    yield tree
    if isinstance(tree, (tuple, list)):
        for x in tree:
            yield from _walk(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _walk(x)


def _adam_states(tree: Any) -> list[Any]:
    """Every state of the optimizer chain that holds Adam's moments (`mu`, `nu`)."""
    return [x for x in _walk(tree) if isinstance(x, tuple) and {"mu", "nu"} <= set(getattr(x, "_fields", ()))]


def _counts(tree: Any) -> list[Tensor]:
    """The optimizer's step counts: its 0-d integer tensors (fz.optim keeps nothing else so)."""
    return [x for x in _walk(tree) if isinstance(x, Tensor) and not isinstance(x, DTensor) and x.dim() == 0
            and not x.is_floating_point() and x.dtype != torch.bool]


def _set_counts(opt_state: Any, ck: Any) -> None:
    """Adam's step count from the optimizer's (bias correction); every other count (the lr
    schedule's) from the scheduler's steps, which can differ (DeepSpeed's stage-0 bf16 optimizer
    steps once while it is set up)."""
    adam = {id(a.count) for a in _adam_states(opt_state)}
    sched = (ck.lr_scheduler or {}).get("last_batch_iteration")
    for count in _counts(opt_state):
        if id(count) in adam or sched is None:
            if ck.optimizer_step is not None:
                count.fill_(int(ck.optimizer_step))
        else:
            count.fill_(int(sched) + 1)


def _moment_places(state: State) -> dict[str, dict[str, list[Place]]]:
    """{moment kind: {canonical name: places}} of the state's Adam moments on this rank."""
    plan, slots = state.plan, state.plan.slots()
    out: dict[str, dict[str, list[Place]]] = {}
    for adam in _adam_states(state.opt_state):
        for kind, field in _MOMENTS.items():
            for name, leaf in getattr(adam, field).items():
                b, s = slots[name]
                local = leaf._local_tensor if isinstance(leaf, DTensor) else leaf
                start, stop = s.local_rows(plan.shard_rank) if isinstance(b.place.opt, Shard) else (0, s.rows)
                out.setdefault(kind, {}).setdefault(name, []).append(
                    (local.reshape(-1), start * s.row_numel, stop * s.row_numel))
    return out


def _trainable(state: State) -> set[str]:
    """The names (aliases too) of the state's trainable parameters."""
    canon = {s.name for b in state.plan.buckets if b.trainable for s in b.slots}
    return canon | {name for name, c in state.skeleton.aliases.items() if c in canon}


def _pairs(ck: Any, state: State) -> tuple[dict[str, str], list[str]]:
    """{fz canonical name: the DeepSpeed name holding its value}, and the differences."""
    stored = {**ck.params, **ck.frozen}
    by_canon: dict[str, list[str]] = {}
    for name, canon in state.skeleton.aliases.items():
        by_canon.setdefault(canon, []).append(name)
    problems, pairs, kept = [], {}, []
    trainable = _trainable(state)
    for canon, (_, s) in state.plan.slots().items():
        names = [canon] + [n for n in by_canon.get(canon, []) if n != canon]
        key = next((n for n in names if n in stored), None)
        if key is None:
            key = next((ck.shared[n] for n in names if n in ck.shared and ck.shared[n] in stored), None)
        if key is None and not ck.frozen and canon not in trainable and ck.params:
            kept.append(canon)  # saved with exclude_frozen_parameters (a PEFT adapter's run): this state's stay
            continue
        if key is None:
            problems.append(f"missing: {canon}")
            continue
        if tuple(stored[key]) != tuple(s.shape):
            problems.append(f"shape mismatch: {canon} is {tuple(s.shape)} here, {tuple(stored[key])} in the checkpoint")
            continue
        pairs[canon] = key
    for key in sorted(set(stored) - set(pairs.values())):
        if state.skeleton.aliases.get(key) not in pairs:
            problems.append(f"unexpected: {key}")
    if kept and not problems:
        log.info("DeepSpeed checkpoint %s holds the trainable parameters only (saved with exclude_frozen_parameters):"
                 " the %d frozen ones keep this state's values", ck.path, len(kept))
    return pairs, problems


def _buffer_pairs(ck: Any, state: State, problems: list[str]) -> dict[str, str]:
    """{fz buffer name: the checkpoint's name} of the buffers both hold; one of another shape, or a
    floating value for an integer buffer (a NaN lands as -2**63 in num_batches_tracked), is a difference
    added to `problems` and not loaded."""
    pairs = {}
    for name, value in ck.buffers.items():
        canon = state.skeleton.aliases.get(name, name)
        mine = state.buffers.get(canon)
        if mine is None:
            continue  # one this model does not keep: not loaded
        if mine.shape != value.shape:
            problems.append(f"shape mismatch: buffer {canon} is {tuple(mine.shape)} here, {tuple(value.shape)} in "
                            "the checkpoint")
        elif value.is_floating_point() and not mine.is_floating_point():
            problems.append(f"buffer {canon} is {value.dtype} in the checkpoint, {mine.dtype} here")
        else:
            pairs[canon] = name
    return pairs


def _refuse_negative(found: dict[str, tuple[int, int]], path: Any) -> None:
    """A negative exp_avg_sq (a running mean of squares) is impossible, though finite: Adam's
    step takes its square root, NaN in the weights. Refused on every rank (the counts are summed)."""
    if found:
        shown = ", ".join(f"{label} {n} of {numel}" for label, (n, numel) in sorted(found.items())[:8])
        raise CheckpointError(f"fz.import_deepspeed: DeepSpeed checkpoint {path} holds negative values in Adam's "
                              f"exp_avg_sq (a mean of squares: never < 0) of {len(found)} tensors: {shown}"
                              f"{', ...' if len(found) > 8 else ''}. Damaged; training from it would write NaN "
                              "into the weights.")


def _fill(places: list[Place], ck: Any, key: str, kind: str, counts: Counts, canon: str) -> None:
    lo, hi = _span(places)
    if hi > lo:
        narrow = _narrowest(places)  # a finite fp32 value past an fp16 place's range lands as inf: counted so
        see = partial(counts.see, canon, kind="" if kind == "fp32" else kind)
        for at, chunk in ck.read(key, kind, lo, hi):
            _see(see, narrow, at, chunk)
            _put(places, at, chunk)


def import_deepspeed(state: State, path: str | os.PathLike[str], *, tag: str | None = None,
                     strict: bool = True, allow_nonfinite: bool = False) -> tuple[State, dict[str, Any]]:
    """Load the DeepSpeed checkpoint at `path` (a save dir, whose `latest` names the tag, or a tag
    folder; `tag` picks another) into the template `state`: weights, Adam's moments and step,
    the step count, loss scale and buffers. Returns (state, client_state). Every rank calls it;
    each reads only what it holds. Names or shapes that differ are a CheckpointError listing them
    (strict=False: a warning, and the rest is loaded); so are moments the state's optimizer has
    no place for. One saved with `exclude_frozen_parameters` (it holds no frozen weight: a PEFT
    run's) leaves this state's frozen parameters as they are. Pickled files are parsed, never
    run: a class outside DeepSpeed's is refused. A NaN or inf in the weights or moments is
    fz.NonFiniteError naming them, on every rank (allow_nonfinite=True: a warning with the counts)."""
    from fz.ckpt.deepspeed.checkpoint import DeepSpeedCheckpoint  # the pickle reader, only when one is read

    expect_state(state, "fz.import_deepspeed")
    template, state = state, block_until_ready(state)  # loaded in place: no bucket may still be arriving
    with DeepSpeedCheckpoint(path, tag, trainable=_trainable(state)) as ck:
        pairs, problems = _pairs(ck, state)
        moments = _moment_places(state)
        if ck.moments and not moments:
            problems.append(f"the checkpoint holds {', '.join(ck.moments)} but this state's optimizer keeps no "
                            "Adam moments (fz.optim.adam/adamw)")
        buffers = _buffer_pairs(ck, state, problems)
        if ck.unplaced and moments:
            problems.append(ck.unplaced + "; this model's trainable parameters do not tell them apart either")
        if problems:
            msg = (f"DeepSpeed checkpoint {ck.path} does not match this state ({len(problems)} differences): "
                   + "; ".join(problems[:8]) + ("; ..." if len(problems) > 8 else ""))
            if strict:
                raise CheckpointError(msg)
            warnings.warn(msg, stacklevel=2)
        places = _places(state)
        counts = Counts(state.plan, ("", *ck.moments), nonnegative=("exp_avg_sq",))
        try:
            new = _load(state, ck, pairs, buffers, places, moments, counts)
        finally:  # filled in place: the template is given up whether the import returns or raises (a value it
            template.donate("fz.import_deepspeed")  # refuses below is already in it), as fz.restore's is
        found = counts.total()
        _refuse_negative(counts.negative, ck.path)
        report(found, allow_nonfinite, "fz.import_deepspeed", f"DeepSpeed checkpoint {ck.path}", 2)
        return new, dict(ck.client_state)


def _load(state: State, ck: Any, pairs: dict[str, str], buffers: dict[str, str], places: dict, moments: dict,
          counts: Counts) -> State:
    """`state` with the checkpoint's values filled into its tensors, its counts and loss scale set."""
    with torch.no_grad():
        for canon, key in pairs.items():
            _fill(places[canon], ck, key, "fp32", counts, canon)
            for kind in ck.moments:
                target = moments.get(kind, {}).get(canon)
                if target is not None and key in ck.params:
                    _fill(target, ck, key, kind, counts, canon)
        for canon, name in buffers.items():  # NaN or +inf counted as a parameter's (-inf: a mask's, kept)
            counts.see(canon, 0, ck.buffers[name])
            state.buffers[canon].copy_(ck.buffers[name])
        _set_counts(state.opt_state, ck)
        scaler = dict(state.scaler or {})
        if "skipped" in scaler:
            scaler["skipped"] = torch.tensor(int(ck.skipped_steps), dtype=torch.int64)
        if "scale" in scaler and ck.loss_scale is not None:
            scaler["scale"] = torch.tensor(float(ck.loss_scale))
    return state.replace(step=torch.full_like(state.step, int(ck.global_steps)), scaler=scaler)
