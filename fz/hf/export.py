"""`save_pretrained`: a live fz State as a Hugging Face model folder that
`AutoModelForCausalLM.from_pretrained(out)` (or the model's own class) loads.

What `transformers`' own `save_pretrained` writes: config.json, generation_config.json (a
model that can generate), the weights as safetensors shards `model-00001-of-0000N.safetensors`
with `model.safetensors.index.json` (one file, `model.safetensors`, when it all fits in one
shard), and the tokenizer or processor if one is given. Names are those transformers' save
writes: tied names once, and transformers 5's load-time conversions reversed tensor by tensor
(Mixtral's experts, fused in memory, saved one by one), so that transformers 4 and other
readers of hub checkpoints read the folder too.

Bounded memory: every name, dtype and shape is known from the state's plan before anything
is gathered, so each shard's safetensors header is written first and the parameters then
stream into their places one bucket at a time (fz.observe.full_params.gathered): no rank
ever holds the whole model, only one gathered bucket (and, on the writing rank, one tensor's
CPU copy in the output dtype). Every rank takes part in the gathers; the first rank of the
state's ranks writes.

Atomic: everything is written into a hidden folder inside `out`, then moved into place with
the weights' entry point (the index, or the single `model.safetensors`) last, so a failure at
any point leaves no folder that `from_pretrained` would load half-written. A rank's failure
(a write on the writing rank, a disk-tier read on any rank) is raised on every rank.
"""
from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fz.ckpt.group import GroupCache, exchange, state_ranks
from fz.ckpt.hf.folder import INDEX, WEIGHTS, filenames, shard_size
from fz.ckpt.hf.folder import shards as cut
from fz.ckpt.hf.safetensors_io import StreamWriter
from fz.ckpt.layout import disk_full, fsync_path
from fz.distributed.arrival import arrive
from fz.errors import ConfigError
from fz.hf.peft_export import is_peft_model, save_peft
from fz.observe.full_params import gathered, source_dtype
from fz.state import State, expect_state
from fz.storage.fresh import fresh_dir, remove_entry

_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_TMP = ".fz-export-"
_GROUPS = GroupCache()  # the gloo groups errors are shared over (never the training group)


@dataclass(frozen=True)
class Exported:
    """What `save_pretrained` wrote: the folder, the weights' files (the shards, then the index
    if there are several), how many tensors and bytes they hold, and their floating dtype."""

    out: str
    files: tuple[str, ...]
    shards: int
    tensors: int
    bytes: int
    dtype: str


@dataclass(frozen=True)
class _Entry:
    name: str  # the name in the file (transformers' saved name)
    source: str  # the canonical name `gathered` yields it under
    key: str  # the state_dict name it comes from (`name` itself, unless transformers converts it on save)
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def save_pretrained(state: State, out: str | os.PathLike[str], *, model: nn.Module | None = None,
                    max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None,
                    processing_class: Any = None, merged: bool = False) -> Exported:
    """Write `state`'s weights with its model's config as a transformers model folder `out`
    (the state first, then where, as fz.save).

    A collective: every rank of the state calls it, with the same arguments. `model`: the
    transformers model the state was made from (its config, generation config and tied-weight
    declarations are read; its tensors are not); by default the state's own copy of its
    structure. `max_shard_size`: bytes per shard file, an int
    or a string such as "5GB" or "500MB" (transformers' units). `processing_class`: a tokenizer
    or processor, saved alongside with its own `save_pretrained`.

    `dtype`: None writes the weights in the precision the run trains in: bf16 (fp16) in a bf16
    (fp16) run, the copy the forward used, as Trainer + DeepSpeed ZeRO-3 writes with
    `stage3_gather_16bit_weights_on_model_save` (and ZeRO 0-2 from its bf16 module); fp32 in an
    fp32 run. A torch.dtype writes the fp32 master weights cast to it: torch.float32 gives
    what DeepSpeed's zero_to_fp32 recovers. config.json's `dtype` names what was written, so
    `from_pretrained` loads it in that dtype.

    Tied weights are written once, as transformers does: of names sharing one tensor, those its
    `_tied_weights_keys` declare are dropped (from_pretrained ties them again). Returns an Exported.

    A model that is not a transformers one (no config with save_pretrained) is written as
    transformers' Trainer.save_model writes it: its state_dict in one model.safetensors, no config.

    A PEFT model (`peft.PeftModel`) is written as PEFT writes it: its adapters only
    (adapter_config.json, adapter_model.safetensors, in `dtype` as above), or with
    `merged=True` the base model with the adapter merged in, in fp32 (fz/hf/peft_export.py).
    """
    expect_state(state, "fz.hf.save_pretrained")
    if model is None:
        model = state.skeleton.root
    if is_peft_model(model):
        files, tensors, nbytes, saved_as = save_peft(state, out, model, merged=merged,
                                                     processing_class=processing_class, dtype=dtype)
        return Exported(out=str(out), files=tuple(files), shards=1, tensors=tensors, bytes=nbytes, dtype=saved_as)
    if merged:
        raise ConfigError("fz.hf.save_pretrained(merged=True) merges a PEFT adapter; the model is not a PeftModel")
    plain = not hasattr(getattr(model, "config", None), "save_pretrained")  # not a transformers model
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ConfigError(f"fz.hf.save_pretrained(dtype={dtype!r}): give None (the precision the run computes in) "
                          "or a floating torch.dtype such as torch.float32 (the fp32 master weights)")
    if len(state.plan.ranks) > 1:  # before the group below is made: one rank alone fails fast, not a hang
        arrive("fz.hf.save_pretrained", state.plan.ranks, state.plan.rank)
    limit = sys.maxsize if plain else shard_size(max_shard_size)  # transformers writes a plain one's in one file
    entries, convert = _entries(state, model, dtype)
    shards = cut([(e, e.nbytes) for e in entries], limit)
    names = filenames(len(shards))
    # what config.json's dtype says, as transformers' model.dtype: the first floating tensor's
    written = next((e.dtype for e in entries if e.dtype.is_floating_point), torch.float32)
    writer = state.plan.rank == state.plan.ranks[0]
    group = _GROUPS.get(state_ranks(state), state.spec.timeout_s) if len(state.plan.ranks) > 1 else None
    what = f"fz.hf.save_pretrained to {out}"

    def agree(err: BaseException | None) -> None:
        if group is not None:
            exchange(group, None, err, what)
        elif err is not None:
            raise err

    out = Path(out)
    job = _Job(out, entries, shards, names, convert) if writer else None
    err = None
    try:
        try:
            if job is not None:
                job.start()
        except Exception as e:  # noqa: BLE001 - shared with the other ranks, then raised
            err = e
        agree(err)
        for name, t in gathered(state, dtype is None, "fz.hf.save_pretrained",
                                agree=lambda e: agree(e or (job.err if job else None))):
            if job is not None:
                job.put(name, t)
        try:
            if job is not None:
                if job.err is not None:
                    raise job.err
                job.finish(model, written, processing_class, _parameters(state))
        except Exception as e:  # noqa: BLE001 - shared with the other ranks, then raised
            err = e
        agree(err)
    except BaseException as e:
        if job is not None:
            job.abort()
            full = None if isinstance(e, (ConfigError, KeyboardInterrupt, SystemExit)) else disk_full(out, e)
            if full is not None:
                raise full from e
        raise
    return Exported(out=str(out), files=(*names, *([INDEX] if len(names) > 1 else [])), shards=len(names),
                    tensors=len(entries),
                    bytes=sum(e.nbytes for e in entries), dtype=str(written).removeprefix("torch."))


def _tied_patterns(model: nn.Module) -> list[str]:
    """The tied names transformers drops on save: every module's `_tied_weights_keys` (a dict
    {target: source} in transformers 5, a list in 4), prefixed by the module's name."""
    out = []
    for prefix, m in model.named_modules():
        tied = getattr(m, "_tied_weights_keys", None) or {}
        out += [f"{prefix}.{k}" if prefix else k for k in tied]
    return out


def _kept(names: list[str], patterns: list[str]) -> list[str]:
    """Of names sharing one tensor, those transformers' remove_tied_weights_from_state_dict keeps:
    in sorted order, each name a tied pattern matches is dropped unless it is the last one left."""
    found, drop = 0, set()
    for n in sorted(names):
        if any(re.search(p, n) for p in patterns):
            found += 1
            if found < len(names):
                drop.add(n)
    return [n for n in names if n not in drop]


Convert = Callable[[dict[str, Tensor]], dict[str, Tensor]]


def _converter(model: Any) -> Convert | None:
    """transformers 5's reversal of its load-time weight conversions (Mixtral's experts fused in
    memory are split again on save), as its save_pretrained applies by default; None before 5."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    return lambda named: revert_weight_conversion(model, named)


def _entries(state: State, model: nn.Module, dtype: torch.dtype | None) -> tuple[list[_Entry], Convert | None]:
    """Every tensor of the files, in the order `gathered` yields their sources, and the conversion
    that turns a state_dict tensor into the saved ones (None: written as they are)."""
    aliases = state.skeleton.aliases
    missing = [n for n, _ in model.named_parameters(remove_duplicate=False) if n not in aliases]
    if missing:
        raise ConfigError(f"fz.hf.save_pretrained: the model has parameters the state does not ({missing[0]!r}, ...): "
                          "pass the model the state was made from")
    names_of: dict[str, list[str]] = {}
    for n, c in aliases.items():
        names_of.setdefault(c, []).append(n)
    patterns = _tied_patterns(model)
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    sources: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
        (s.name, source_dtype(state, b, dtype is None), tuple(s.shape)) for b in state.plan.buckets for s in b.slots]
    sources += [(n, state.buffers[n].dtype, tuple(state.buffers[n].shape))
                for n in state.skeleton.persistent if n in state.buffers]
    kept = []
    for src, dt, shape in sources:
        dt = dtype if dtype is not None and dt.is_floating_point else dt
        names = names_of.get(src, [src])
        kept += [_Entry(n, src, n, dt, shape) for n in (_kept(names, patterns) if len(names) > 1 else names)
                 if n not in ignored]
    convert = _converter(model)
    if convert is None:
        return kept, None
    try:  # on the meta device: the saved names, dtypes and shapes, before anything is gathered
        out = [_Entry(k, e.source, e.key, t.dtype, tuple(t.shape)) for e in kept
               for k, t in convert({e.key: torch.empty(e.shape, dtype=e.dtype, device="meta")}).items()]
    except Exception:  # noqa: BLE001 - a conversion that needs several tensors at once: transformers 5's own names
        return kept, None
    if len({e.name for e in out}) != len(out):
        return kept, None
    return out, convert


def _parameters(state: State) -> int:
    """transformers' num_parameters(): each parameter once (a tied pair counts once)."""
    return sum(s.numel for b in state.plan.buckets for s in b.slots)


class _Job:
    """The writing rank's side: the shard writers in a hidden folder, then the move into place."""

    def __init__(self, out: Path, entries: list[_Entry], shards: list[list[_Entry]], names: list[str],
                 convert: Convert | None):
        self.out, self.entries, self.shards, self.names, self.convert = out, entries, shards, names, convert
        self.tmp = out / f"{_TMP}{os.getpid()}"
        self.writers: list[StreamWriter] = []
        self.where: dict[str, dict[str, list[tuple[StreamWriter, _Entry]]]] = {}  # source -> key -> its files
        self.err: BaseException | None = None

    def start(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for stale in self.out.glob(f"{_TMP}*"):  # left by an export that was killed (a planted link: unfollowed)
            remove_entry(stale)
        fresh_dir(self.tmp)
        for name, shard in zip(self.names, self.shards):
            w = StreamWriter(self.tmp / name, [(e.name, e.dtype, e.shape) for e in shard], {"format": "pt"})
            self.writers.append(w)
            for e in shard:
                self.where.setdefault(e.source, {}).setdefault(e.key, []).append((w, e))

    def put(self, source: str, t: Tensor) -> None:
        """Write tensor `source` under each of its names (after a failure: skip, and keep gathering)."""
        if self.err is not None:
            return
        try:
            for key, places in self.where.get(source, {}).items():
                t = t.detach().to("cpu", places[0][1].dtype)
                saved = self.convert({key: t}) if self.convert is not None else {key: t}
                for w, e in places:
                    w.write(e.name, saved[e.name])
        except Exception as e:  # noqa: BLE001 - raised on every rank at the next agreement
            self.err = e

    def finish(self, model: nn.Module, written: torch.dtype, processing_class: Any, parameters: int) -> None:
        for w in self.writers:
            w.close()
        self.writers = []
        if len(self.names) > 1:
            index = {"metadata": {"total_parameters": parameters, "total_size": sum(e.nbytes for e in self.entries)},
                     "weight_map": {e.name: n for n, shard in zip(self.names, self.shards) for e in shard}}
            (self.tmp / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        if hasattr(getattr(model, "config", None), "save_pretrained"):
            cfg: Any = copy.deepcopy(model.config)
            setattr(cfg, "dtype" if hasattr(cfg, "dtype") else "torch_dtype", str(written).removeprefix("torch."))
            cfg.architectures = [type(model).__name__]
            cfg.save_pretrained(self.tmp)
            save_generation_config(model, self.tmp)
        if processing_class is not None:
            processing_class.save_pretrained(self.tmp)
        self._commit()

    def _commit(self) -> None:
        """Move the files into `out`: first take away the old weights' entry points and stale shards
        (a half-moved folder then has none), then the new files, the new entry point last."""
        entry = INDEX if len(self.names) > 1 else WEIGHTS
        files = sorted(p.name for p in self.tmp.iterdir())
        for old in [INDEX, WEIGHTS, *(p.name for p in self.out.iterdir() if _SHARD.fullmatch(p.name))]:
            if old not in files or old == entry:
                (self.out / old).unlink(missing_ok=True)
        fsync_path(self.out)
        for name in [*(f for f in files if f != entry), entry]:
            _move(self.tmp / name, self.out / name)
        fsync_path(self.out)
        self.tmp.rmdir()

    def abort(self) -> None:
        for w in self.writers:
            w.abort()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _move(src: Path, dst: Path) -> None:
    """Rename `src` over `dst` (a tokenizer may save a folder: it replaces the old one)."""
    if src.is_dir() and dst.is_dir():
        shutil.rmtree(dst)
    os.replace(src, dst)


def save_generation_config(model: Any, folder: str | Path) -> None:
    """generation_config.json, as `save_pretrained` writes it: for a model that can generate."""
    can_generate, generation = getattr(model, "can_generate", None), getattr(model, "generation_config", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(folder)
