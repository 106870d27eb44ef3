"""`fz.load_weights`: a state's parameters from a safetensors file or a Hugging Face folder,
each rank reading only its rows, straight into the tier the state keeps them in.

Every tensor is written where it lives: the device, host memory, or (a DiskTensor of the
NVMe tier) its file, through the DiskTensor's own `copy_`, one slice at a time, so no bucket
is ever materialised whole. A rank reads the elements it holds of each parameter (its Shard(0)
rows; the whole tensor where it is replicated), in chunks of at most `weights.CHUNK_BYTES`,
and copies each chunk into the compute-dtype parameter and the fp32 master weights (cast from
the file's dtype: a bf16 file gives fp32 masters equal to its values). The memory a load adds
to the state's is therefore one chunk and its cast, whatever the model's size; a tensor that
transformers converts at load time (Mixtral's fused experts) is the exception: it is built
whole from its sources (about twice that tensor), as transformers builds it. NaN and inf are
counted in the narrowest dtype a value lands in, so a value finite in the file that overflows
it (an F64 1e300 into fp32) is refused as the inf it would become.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from functools import partial

import torch
from torch import Tensor
from torch.distributed.tensor import Shard

from fz.ckpt.finite import Counts, report
from fz.ckpt.hf.mismatch import lead, listed
from fz.ckpt.hf.names import Match, match
from fz.ckpt.hf.weights import CHUNK_BYTES, Entry, WeightFiles, read, read_all
from fz.distributed.arrival import arrive
from fz.errors import CheckpointError
from fz.model.skeleton import Skeleton
from fz.sharding.plan import ShardPlan
from fz.state import State, block_until_ready, expect_state

Place = tuple[Tensor, int, int]  # a flat (1-D) local view, and the [lo, hi) elements of the tensor it holds


def targets_of(plan: ShardPlan, skeleton: Skeleton, buffers: Mapping[str, Tensor]) -> dict[str, tuple[int, ...]]:
    """{canonical name: shape} of what a weights file fills: every parameter, and the buffers of
    the state_dict (persistent ones, e.g. BatchNorm's statistics)."""
    out = {s.name: tuple(s.shape) for b in plan.buckets for s in b.slots}
    out.update((n, tuple(buffers[n].shape)) for n in skeleton.persistent if n in buffers)
    return out


def resolve(path: str | os.PathLike[str], plan: ShardPlan, skeleton: Skeleton, buffers: Mapping[str, Tensor],
            strict: bool) -> tuple[WeightFiles, Match]:
    """Read the headers and pair names (nothing else is read): a CheckpointError naming the
    differences when `strict`, else a warning and the tensors both have. Needs only the state's
    plan, skeleton and buffers' shapes, so fz.init checks a folder before it allocates a state."""
    files = WeightFiles(path)
    m = match(files.entries, targets_of(plan, skeleton, buffers), skeleton.aliases, skeleton.root)
    problems = m.problems
    if problems:
        why, names = lead(path, skeleton.root, m), listed(m)
        msg = (f"weights {path} do not match this model ({len(problems)} differences): {names}" if why is None
               else f"weights {path} do not match this model: {why}. The {len(problems)} differences: {names}")
        if strict:
            raise CheckpointError(msg)
        warnings.warn(msg, stacklevel=3)
        bad = {p.split(": ", 1)[1].split(" ")[0] for p in problems if p.startswith("shape mismatch")}
        m.direct = {c: k for c, k in m.direct.items() if k not in bad}
        m.groups = [g for g in m.groups if not any(n in bad for n in g.outputs)]
    return files, m


def _places(state: State) -> dict[str, list[Place]]:
    """Where each canonical name's values go on this rank: the parameter's local view, the fp32
    master's (mixed precision), and a persistent buffer; with the elements each holds."""
    plan = state.plan
    out: dict[str, list[Place]] = {}

    def add(views: list[Tensor], b, sharded: bool) -> None:
        for s, v in zip(b.slots, views):
            start, stop = s.local_rows(plan.shard_rank) if sharded else (0, s.rows)
            out.setdefault(s.name, []).append((v.reshape(-1), start * s.row_numel, stop * s.row_numel))

    for b, flat in zip(plan.buckets, state.param_flats):
        add(plan.param_locals(flat._local_tensor, b), b, b.sharded_param)
        m = state.master_flats.get(b.index)
        if m is not None and state.spec.precision != "fp32":
            add(plan.master_locals(m._local_tensor, b), b, isinstance(b.place.opt, Shard))
    for n in state.skeleton.persistent:
        if n in state.buffers:
            t = state.buffers[n]
            out.setdefault(n, []).append((t.view(-1), 0, t.numel()))
    return out


def _put(places: list[Place], at: int, chunk: Tensor) -> None:
    """Copy elements [at, at + len(chunk)) of a tensor into each place that holds some of them."""
    end = at + chunk.numel()
    for view, lo, hi in places:
        a, z = max(at, lo), min(end, hi)
        if a < z:
            view[a - lo:z - lo].copy_(chunk[a - at:z - at])


def _narrowest(places: list[Place]) -> torch.dtype | None:
    """The floating dtype of the places with the smallest range (None: no floating place). A value
    finite in the file but past that range (an F64 1e300 into fp32, an F32 1e5 into fp16) lands as
    inf there, so values are counted as cast to it, not as the file holds them."""
    floats = {v.dtype for v, _, _ in places if v.is_floating_point()}
    return min(floats, key=lambda d: torch.finfo(d).max) if floats else None


def _see(see: Callable[[int, Tensor], None], narrow: torch.dtype | None, at: int, t: Tensor) -> None:
    """Count the non-finite values of `t` (elements from `at`) as they land in `narrow`, one bounded
    piece at a time."""
    if narrow is None or t.dtype == narrow or (t.is_floating_point()
                                               and torch.finfo(t.dtype).max <= torch.finfo(narrow).max):
        see(at, t)  # every value finite here is finite there
        return
    step = max(1, CHUNK_BYTES // max(t.element_size(), 1))
    for i, piece in enumerate(t.split(step)):
        see(at + i * step, piece.to(narrow))


def _stream(places: list[Place], e: Entry, lo: int, hi: int, see: Callable[[int, Tensor], None]) -> None:
    narrow = _narrowest(places)
    for at, chunk in read(e, lo, hi):
        _see(see, narrow, at, chunk)
        _put(places, at, chunk)


def _span(places: list[Place]) -> tuple[int, int]:
    spans = [(lo, hi) for _, lo, hi in places if hi > lo]
    return (min(s[0] for s in spans), max(s[1] for s in spans)) if spans else (0, 0)


def fill(state: State, files: WeightFiles, m: Match, *, allow_nonfinite: bool = False,
         who: str = "fz.load_weights", stacklevel: int = 3) -> None:
    """Write the matched tensors into `state`'s storage, where it lives (in place), counting the
    NaN and inf of each parameter and persistent buffer as it is read: fz.NonFiniteError on every
    rank naming them (`allow_nonfinite`: a warning with the counts; fz/ckpt/finite.py); a floating
    tensor for an integer buffer is refused."""
    places = _places(state)
    entries = files.entries
    for c, key in m.direct.items():  # a float into an integer buffer (num_batches_tracked): NaN lands as -2**63
        if entries[key].dtype.is_floating_point and not any(v.is_floating_point() for v, _, _ in places[c]):
            raise CheckpointError(f"weights {files.path}: {key[:100]!r} is {entries[key].dtype} in the file, "
                                  f"{places[c][0][0].dtype} here: damaged, or another model's")
    counts = Counts(state.plan)
    with torch.no_grad():
        for c, key in sorted(m.direct.items(), key=lambda kv: (str(entries[kv[1]].file), entries[kv[1]].begin)):
            lo, hi = _span(places[c])
            see = partial(counts.see, c)
            _guarded(key, entries[key],
                     lambda e=entries[key], lo=lo, hi=hi, p=places[c], s=see: _stream(p, e, lo, hi, s))
        for g in m.groups:
            converted = g.realize(state.skeleton.root, lambda k: _guarded(k, entries[k], lambda: read_all(entries[k])))
            for name, c in g.outputs.items():
                t = converted.pop(name).reshape(-1)
                _see(partial(counts.see, c), _narrowest(places[c]), 0, t)
                lo, hi = _span(places[c])
                _put(places[c], lo, t[lo:hi])
                del t
    report(counts.total(), allow_nonfinite, who, f"weights {files.path}", stacklevel)


def _guarded(key: str, e: Entry, fn):
    try:
        return fn()
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - a damaged file or a failing tier, named
        raise CheckpointError(f"cannot load {key!r} from weights file {e.file} ({type(err).__name__}: {err})") from err


def load_weights(state: State, path: str | os.PathLike[str], *, strict: bool = True,
                 allow_nonfinite: bool = False) -> State:
    """Fill the parameters (and fp32 master weights) and the state_dict's buffers from a
    safetensors file, or a Hugging Face folder (`model.safetensors.index.json` and its shards,
    or `model.safetensors`).

    Names are the model's state_dict names (fz.full_params's keys, the HF convention); a tied
    parameter is found under any of its names; a transformers model's load-time conversions
    (renames, Mixtral's fused experts) are applied as `from_pretrained` applies them. Each rank
    reads only the rows it holds, into the tier the state keeps them in (device, host, or the
    NVMe files), one bounded chunk at a time. The optimizer state is kept. Missing, unexpected
    or mis-shaped tensors are a CheckpointError (a ConfigError) naming them, before anything is
    read (strict=False: a warning, and the tensors both have are loaded). Pickled weights are
    never read; a file whose header safetensors would refuse is refused. A NaN or inf in a
    parameter is fz.NonFiniteError naming the tensors, on every rank (allow_nonfinite=True: a
    warning with the counts). Returns the state (filled in place).
    """
    expect_state(state, "fz.load_weights")
    if len(state.plan.ranks) > 1:  # one rank alone fails fast, not at the counts' all-reduce after the timeout
        arrive("fz.load_weights", state.plan.ranks, state.plan.rank)
    state = block_until_ready(state)
    files, m = resolve(path, state.plan, state.skeleton, state.buffers, strict)
    fill(state, files, m, allow_nonfinite=allow_nonfinite)
    return state
