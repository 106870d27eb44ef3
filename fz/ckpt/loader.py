"""Restoring: verify a checkpoint, then load it in place into a template state.

DCP reshards on load: each rank reads the rows its template tensors hold, so a
checkpoint restores at any world size, ZeRO stage or precision the template was built
with. The template's buffers are filled in place (its parameters are views of the
bucket storage) and it is donated: the returned state replaces it.

RNG: rank r gets the generator state rank r saved. A rank that did not exist when the
checkpoint was written (restoring on more ranks) gets a generator seeded with
module_seed(spec.seed, "restore/step<N>/rank<r>"): deterministic, distinct per rank.
Data position: rank r gets rank r's, or rank 0's when rank r did not exist.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from fz.ckpt import manifest
from fz.ckpt.finite import buffers_found, nonfinite_as, owned_locals, report, summed
from fz.ckpt.group import agree, dcp_error, exchange, run_local
from fz.ckpt.index import SafeReader
from fz.ckpt.layout import META, PathLike, read_json, resolve
from fz.ckpt.reader import read_metadata
from fz.ckpt.tree import MARKERS, MAX_ENCODED_DEPTH, decode, entries, malformed, tensor_refs, too_deep
from fz.errors import CheckpointError, ConfigError
from fz.model.materialize import module_seed
from fz.precision import MAX_LOSS_SCALE, MAX_SCALE_POWER
from fz.rng import problem as rng_problem
from fz.rng import seeded, well_formed
from fz.state import MAX_STEPS, State, block_until_ready

_SHOWN = 5


class PartialRestoreWarning(UserWarning):
    """restore(strict=False) skipped tensors that the checkpoint and the template do not share;
    `.skipped` lists every one (the message shows the first few)."""

    def __init__(self, message: str, skipped: tuple[str, ...] = ()):
        super().__init__(message)
        self.skipped = skipped


_KINDS = (("model/", "model"), ("opt/", "optimizer"), ("buffers/", "buffers"), ("scaler/", "loss scaler"))


def _kind(line: str) -> str:
    key = line.split(": ", 1)[1]
    return next((name for prefix, name in _KINDS if key.startswith(prefix)), "state")


def _mismatch_title(lines: list[str]) -> str:
    """'this model', or 'this optimizer (the model matches)': what the differences are about."""
    kinds = list(dict.fromkeys(_kind(line) for line in lines))
    title = " and ".join(f"this {k}" for k in kinds)
    if "model" not in kinds:
        title += " (the model matches"
        title += (": the checkpoint was saved with another optimizer or optimizer settings)"
                  if "optimizer" in kinds else ")")
    return title


def _verify(path: PathLike, step: int | None, rank: int, world: int, key: bytes | None) -> tuple[Path, set[str]]:
    """Resolve the directory; the signature (given a key) and sizes on every rank, checksums
    split across ranks. Returns it and the files its manifest lists: no other file is read."""
    d = resolve(path, step)
    files = manifest.read(d, key)
    manifest.check_sizes(d, files)
    manifest.check_sums(d, files, sorted(files)[rank::world])
    return d, set(files)


def _refs(tree: Any, prefix: str, file: Path, saved: dict[str, Any]) -> list[str]:
    """The tensors an encoded tree of `file` refers to: its own (`prefix`...) and in the checkpoint.
    A reference to a weight would load it there and leave the weight unrestored."""
    if too_deep(tree, MAX_ENCODED_DEPTH):
        raise CheckpointError(f"checkpoint file {file}: its {prefix.rstrip('/')} tree nests deeper than "
                              f"{MAX_ENCODED_DEPTH} levels, more than fz.save writes: damaged or altered")
    odd = malformed(tree)
    if odd is not None:
        raise CheckpointError(f"checkpoint file {file}: its {prefix.rstrip('/')} tree holds {odd}, which fz.save "
                              "never writes: damaged or altered")
    refs = tensor_refs(tree)
    bad = [r for r in refs if not isinstance(r, str) or not r.startswith(prefix) or r not in saved]
    if bad:
        raise CheckpointError(f"checkpoint file {file} refers to tensor {str(bad[0])[:80]!r}, which is not one of its "
                              f"own ({prefix}...) in the checkpoint: damaged or altered")
    return refs


_SQUARES = ("nu", "v", "v_rows", "v_cols")  # the optimizers' means of squared gradients: never negative


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


# |mu| / sqrt(nu) of Adam's moments is at most (1 - b1) / sqrt((1 - b2)(1 - b1^2 / b2)) (Cauchy-Schwarz
# over the gradients both average): about 7 at the usual betas; past this, the next update overflows
_MU_OVER_ROOT_NU = 1e30
_CHUNK = 1 << 22  # elements compared at a time: temporaries of 16 MiB, not of an embedding's size


def _mean_past_its_squares(mu: Tensor, nu: Tensor) -> int:
    """Elements of Adam's mean `mu` no run of gradients gives beside their mean of squares `nu`:
    the next update, about lr x mu / sqrt(nu), would put inf into the weights (a finite 3e38 did)."""
    if mu.shape != nu.shape or not mu.is_floating_point() or not nu.is_floating_point():
        return 0
    mu, nu, bad = mu.reshape(-1), nu.reshape(-1), 0
    for i in range(0, mu.numel(), _CHUNK):
        m, v = mu[i:i + _CHUNK].float().abs(), nu[i:i + _CHUNK].float().clamp_min(0).sqrt()
        bad += int((m > _MU_OVER_ROOT_NU * (v + 1e-30)).sum())
    return bad


def _impossible(tensors: dict[str, Tensor]) -> list[str]:
    """Finite values no run writes: a step count below 0 or past MAX_STEPS, a negative mean of squares,
    a mean too large for its mean of squares. Adam's next step would put NaN or inf into the weights
    (1 - beta2 ** count, the square root of nu, mu / sqrt(nu))."""
    out = []
    for key, t in tensors.items():
        parts = key.split("/")
        if parts[0] == "scaler":
            out += _impossible_scaler(key, _local(t))
        if key == "step" and _local(t).numel() == 1 and not 0 <= int(_local(t)) <= MAX_STEPS:
            out.append(f"step = {int(_local(t))} (the update count: from 0 to 2**48)")
        if parts[0] != "opt":
            continue
        local = _local(t)
        counted = parts[-1] == "count" and local.dim() == 0 and not local.is_floating_point()
        if counted and not 0 <= int(local) <= MAX_STEPS:
            out.append(f"{key} = {int(local)} (a step count: from 0 to 2**48)")
        elif len(parts) > 2 and parts[-2] in _SQUARES and local.is_floating_point() and local.numel():
            if float(local.min()) < 0:  # no temporary of the tensor's size unless one is bad
                out.append(f"{key} has {int((local < 0).sum())} negative values (a mean of squares)")
            mu = tensors.get("/".join([*parts[:-2], "mu", parts[-1]])) if parts[-2] == "nu" else None
            bad = _mean_past_its_squares(_local(mu), local) if mu is not None else 0
            if bad:
                out.append(f"{'/'.join([*parts[:-2], 'mu', parts[-1]])} has {bad} values over {_MU_OVER_ROOT_NU:g} "
                           "x the square root of nu's (a mean beside its mean of squares)")
    return out


# hysteresis: the overflows left before the scale halves, at least 1 (0 never halved it: every step skipped)
_SCALER_LOWEST = {"iter": 0, "skipped": 0, "skipped_in_a_row": 0, "hysteresis": 1, "last_overflow": -1}


def _impossible_scaler(key: str, t: Tensor) -> list[str]:
    """A loss scale that is not a finite number > 0 (0 divides by zero, NaN or inf skips every step
    silently), or a negative count."""
    if t.numel() != 1:
        return [f"{key} holds {t.numel()} values, not one"]
    name, x = key.split("/")[-1], t.item()
    if name == "scale" and not 0 < x <= MAX_LOSS_SCALE:
        return [f"{key} = {x} (a loss scale: a number > 0, at most 2**{MAX_SCALE_POWER}, past which every fp16 "
                "gradient overflows)"]
    if name in _SCALER_LOWEST and not _SCALER_LOWEST[name] <= x <= MAX_STEPS:
        return [f"{key} = {x} (a count, from {_SCALER_LOWEST[name]} to 2**48)"]
    return []


def _differences(target: dict[str, Tensor], saved: dict[str, Any]) -> tuple[list[str], set]:
    """Human-readable mismatches and the template keys they concern."""
    lines, bad = [], set()
    for k, t in target.items():
        m = saved.get(k)
        if m is None or not hasattr(m, "size"):
            lines.append(f"missing in checkpoint: {k} {tuple(t.shape)}")
            bad.add(k)
        elif tuple(m.size) != tuple(t.shape):
            lines.append(f"shape mismatch: {k} is {tuple(m.size)} in the checkpoint, {tuple(t.shape)} here")
            bad.add(k)
    for k, m in saved.items():
        if k.startswith(("model/", "opt/", "buffers/")) and k not in target:
            lines.append(f"unexpected in checkpoint: {k} {tuple(getattr(m, 'size', ()))}")
    return lines, bad


def _fresh(t: Tensor) -> Tensor:
    return torch.empty_like(t)


def _empty_for(m) -> Tensor:
    return torch.empty(tuple(m.size), dtype=m.properties.dtype)


def _derived_rng(state: State, step: int, rank: int) -> Tensor:
    return seeded(module_seed(state.spec.seed, f"restore/step{step}/rank{rank}"), state.plan.device)


def _params_from_master(state: State) -> None:
    """Mixed precision: params = master weights cast to the compute dtype, in place."""
    master = state.master
    assert master is not None  # called in mixed precision only
    for name, m in master.items():
        p = state.params[name]
        src = m if tuple(m.placements) == tuple(p.placements) else m.redistribute(m.device_mesh, p.placements)
        p._local_tensor.copy_(src.to_local())


def _template(state: State, saved: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Tensor], Any]:
    """The tensors to load into: the state's (in place), fresh buffers, a copy of the scaler."""
    # what restore fills besides entries(state)
    target = dict(entries(state))
    buffers = {k: _fresh(t) for k, t in state.buffers.items()}
    target.update((f"buffers/{k}", t) for k, t in buffers.items())
    scaler = None
    if state.scaler is not None:  # a checkpoint without a scaler keeps the template's initial one
        scaler = {k: t.clone() for k, t in state.scaler.items()}
        for k, t in scaler.items():
            target.pop(f"scaler/{k}")
            if f"scaler/{k}" in saved:
                target[f"scaler/{k}"] = t
    return target, buffers, scaler


def load(state: State, path: PathLike, group, *, step: int | None = None, strict: bool = True,
         with_client_state: bool = False, who: str = "restore", stacklevel: int = 2,
         key: bytes | None = None, allow_nonfinite: bool = False) -> State | tuple[State, dict[str, Any]]:
    """Load the checkpoint `path` names (its `latest`, or `step`) into the template `state`
    over `group`; every rank calls it (the Checkpointer has checked the state and waited).

    A damaged checkpoint (missing, truncated or corrupted file) or one of another model
    raises ConfigError; with strict=False the tensors both share are loaded and the rest is
    reported as a PartialRestoreWarning (`stacklevel` as in warnings.warn, from here). A NaN or
    inf in the weights or optimizer state is fz.NonFiniteError on every rank, once the template
    is donated (`allow_nonfinite`: a warning; fz/ckpt/finite.py).
    """
    template, state = state, block_until_ready(state)  # loaded in place: no bucket may still be arriving
    policy = state.spec.offload if state.spec.offload is not None and state.spec.offload.active else None
    if policy is not None:  # DCP loads into memory; the restored leaves go back to the template's tiers below
        from fz.offload.policy import none
        state = none()(state)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    verified, err = run_local(_verify, path, step, rank, world, key)
    agree(group, err, f"verifying checkpoint {path}")
    d, listed = verified

    def plan():
        meta = read_json(d / META)
        step = meta.get("train_step") if isinstance(meta, dict) else None
        if type(step) is not int or not 0 <= step <= MAX_STEPS:
            raise CheckpointError(f"checkpoint file {d / META} is damaged: it is not an object with a train_step "
                                  "from 0 to 2**48")
        saved = read_metadata(d).state_dict_metadata
        target, buffers, scaler = _template(state, saved)
        lines, bad = _differences(target, saved)
        load = {k: t for k, t in target.items() if k not in bad}
        floats = [k for k, t in load.items() if k.startswith("buffers/") and not t.is_floating_point()
                  and saved[k].properties.dtype.is_floating_point]
        if floats:  # a NaN lands as -2**63 in an integer buffer (num_batches_tracked)
            raise CheckpointError(f"checkpoint {d}: {floats[0]} is {saved[floats[0]].properties.dtype} in it, "
                                  f"{load[floats[0]].dtype} here: damaged or altered")
        rng_key = f"rng/{rank}"
        if rng_key in saved:
            m = saved[rng_key]
            if not well_formed(m.properties.dtype, tuple(m.size)):
                raise CheckpointError(f"checkpoint {d}: {rng_key} is {m.properties.dtype} of size {list(m.size)}, not "
                                      "a generator's state (bytes, as torch.get_rng_state gives): damaged or altered")
            rng = load[rng_key] = _empty_for(m)
        else:
            rng = _derived_rng(state, int(meta["train_step"]), rank)
        # a new rank gets rank 0's; only a file the (verified) manifest lists is read
        name = f"data_{rank}.json" if f"data_{rank}.json" in listed else "data_0.json"
        data_file = d / name
        if name not in listed:
            raise CheckpointError(f"checkpoint {d} is damaged: its manifest lists no {name}")
        rank_json = read_json(data_file)
        if not isinstance(rank_json, dict) or "data" not in rank_json:
            raise CheckpointError(f"checkpoint file {data_file} is damaged: it holds no 'data' entry")
        data_json = rank_json["data"]
        per_rank = meta.get("client_state_per_rank")
        client_json = rank_json.get("client", {}) if per_rank else meta.get("client_state", {})
        if not isinstance(client_json, dict) or (len(client_json) == 1 and next(iter(client_json)) in MARKERS):
            raise CheckpointError(f"checkpoint {d}: its client_state {str(client_json)[:60]!r} is not the dict of "
                                  "names fz.save writes: damaged or altered")
        refs = _refs(data_json, "data/", data_file, saved) + _refs(client_json, "client/", data_file if per_rank
                                                                   else d / META, saved)
        extra = {k: _empty_for(saved[k]) for k in refs}
        load.update(extra)
        return load, buffers, scaler, lines, rng, (data_json, client_json, extra, step)

    planned, err = run_local(plan)
    lines = planned[3] if err is None else []
    if lines and strict:
        shown = "\n  ".join(lines[:_SHOWN])
        more = f"\n  ... and {len(lines) - _SHOWN} more" if len(lines) > _SHOWN else ""
        err = ConfigError(f"checkpoint {d} does not match {_mismatch_title(lines)} ({len(lines)} differences):\n  "
                          f"{shown}{more}\nPass strict=False to restore the tensors both have.")
    elif lines and not any(k.startswith("model/") for k in planned[0]):
        err = ConfigError(f"checkpoint {d} holds none of this model's parameters ({len(lines)} differences, e.g. "
                          f"{lines[0]}): it is another model's, and restoring it (even with strict=False) would only "
                          "adopt its step count and leave every tensor at its initial value")
    agree(group, err, f"reading checkpoint {path}")
    load, buffers, scaler, lines, rng, (data_json, client_json, extra, train_step) = planned
    if lines:
        warnings.warn(PartialRestoreWarning(
            f"{who}(strict=False) from {d}: {len(lines)} tensors not restored (warning.skipped lists them): "
            + "; ".join(lines[:_SHOWN]) + (" ..." if len(lines) > _SHOWN else ""), tuple(lines)), stacklevel=stacklevel)
    err, found = None, {}  # found: {label: (non-finite values, values)} this rank counts
    try:
        dcp.load(load, storage_reader=SafeReader(d), process_group=group)
        narrow = {f"model/{n}": nonfinite_as(p.dtype) for n, p in state.params.items()} if state.master else {}
        found = owned_locals({k: t for k, t in load.items() if k.startswith(("model/", "opt/"))}, rank == 0, narrow)
        if rank == 0:
            found.update(buffers_found({k: t for k, t in buffers.items() if f"buffers/{k}" in load}))
        impossible = _impossible(load)
        if "step" in load and int(_local(load["step"])) != train_step:  # the data's position is bounded by it
            impossible.append(f"step = {int(_local(load['step']))}, where {META} says train_step = {train_step}")
        if impossible:
            err = CheckpointError(f"checkpoint {d} holds step, optimizer or loss-scale values no run writes, which "
                                  "would put NaN into the weights, skip every step or misplace the data: "
                                  f"{'; '.join(impossible[:_SHOWN])}{' ...' if len(impossible) > _SHOWN else ''}. "
                                  "Damaged or altered")
        bad_rng = rng_problem(rng) if f"rng/{rank}" in load else None
        if bad_rng is not None and err is None:
            err = CheckpointError(f"checkpoint {d}: rng/{rank}, this rank's generator state: {bad_rng}. Damaged or "
                                  "altered")
    except CheckpointException as e:
        err = dcp_error(e, "loading checkpoint", d, rank)
    caller = who if who.startswith("fz.") else f"fz.{who}"
    try:
        found = summed(exchange(group, found, err, f"loading checkpoint {d}"))
    except BaseException:  # loaded into in place, then refused (or cut off): the template is given up
        template.donate(caller)
        raise
    if state.master is not None:
        _params_from_master(state)
    new = state.replace(rng=rng, buffers=buffers, scaler=scaler, data=decode(data_json, extra))
    if policy is not None:
        new = policy(new)
    template.donate(caller)
    report(found, allow_nonfinite, who, f"checkpoint {d}", stacklevel)
    if with_client_state:
        return new, decode(client_json, extra)
    return new
