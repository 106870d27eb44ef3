"""A DeepSpeed checkpoint, read without running its pickles and one parameter slice at a time.

`DeepSpeedCheckpoint(path)` opens a save_dir (its `latest` tag) or a tag folder written by
`engine.save_checkpoint` at ZeRO stage 0-3 (fp32, bf16), or by ds_to_universal. Opening reads
only the files' pickled metadata (ds_pickle: tensors stay references into the files); `read`
then streams a parameter's fp32 master or Adam moment, whatever the ranks it was split over
(layouts: ds_layout), so memory stays near one chunk, not the model or one rank's partition.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import torch

from fz.ckpt.deepspeed import fields
from fz.ckpt.deepspeed import files as ds_files
from fz.ckpt.deepspeed import layout as ds_layout
from fz.ckpt.deepspeed import match as ds_match
from fz.ckpt.deepspeed import ranks as ds_ranks
from fz.ckpt.deepspeed import unpickle as ds_pickle
from fz.ckpt.deepspeed.layout import Piece
from fz.ckpt.deepspeed.unpickle import DSObject, Lazy
from fz.ckpt.hf.weights import CHUNK_BYTES
from fz.ckpt.regular import inside
from fz.errors import CheckpointError
from fz.state import MAX_STEPS

log = logging.getLogger(__name__)

# what DeepSpeed's load_checkpoint takes for itself (engine._load_checkpoint's deepspeed_states, with the optimizer
# and lr scheduler it loads): it returns every other key of the file as the client state, its own metadata
# (ds_config, param_shapes...) and keys such as Megatron's "iteration" among them; fz returns the same
_LOADED = frozenset({"module", "optimizer", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps",
                     "global_steps", "dp_world_size", "mp_world_size"})
# DeepSpeed's copy of the frozen weights, already in the state: returned as None rather than read twice
_FROZEN_COPY = "frozen_param_fragments"
_MOMENTS = ("exp_avg", "exp_avg_sq")


class DeepSpeedCheckpoint:
    """What a DeepSpeed checkpoint holds (fields below) and `read` for its parameters' values."""

    def __init__(self, path: str | os.PathLike[str], tag: str | None = None,
                 trainable: Collection[str] | None = None):
        """`trainable`: the names (aliases too) the target model trains, if known: they place a stage-0
        file's unnamed optimizer parameters where shape and value leave several ways."""
        self._trainable = None if trainable is None else frozenset(trainable)
        self.unplaced: str | None = None  # why the moments are not read, though the file holds them
        self.path, self.tag = ds_files.resolve(Path(path), tag)
        ds_files.refuse_parallel(self.path)
        self._model_file = ds_files.model_file(self.path)
        m = self._load(self._model_file)
        if not isinstance(m, dict) or not isinstance(m.get("module"), dict):
            raise CheckpointError(f"{self._model_file} is not a DeepSpeed model-states file (no 'module' state dict)")
        self._m, self._module = m, m["module"]
        try:
            self._fields(m)
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{self._model_file} is not a DeepSpeed model-states file fz reads "
                                  f"({type(e).__name__}: {e})") from e
        try:
            if self._universal:
                self._read_universal()
            elif self._optim:
                self._read_zero(*self._optim)
            else:
                self._read_stage0()
            self._tied()
            for by_name in self._pieces.values():
                for name, pieces in by_name.items():
                    ds_layout.check(name, pieces, math.prod(self._shape_of(name)))
        except (ValueError, KeyError, IndexError, TypeError, AttributeError, OverflowError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"DeepSpeed checkpoint {self.path} does not have the layout fz reads "
                                  f"({type(e).__name__}: {e})") from e
        self.loss_scale: float | None = None
        if self.precision == "fp16" and self.loss_scaler is not None:
            cur = self.loss_scaler.get("cur_scale")
            self.loss_scale = fields.scale(cur, self._scaler_file, "loss_scaler cur_scale")
        log.debug("DeepSpeed checkpoint %s: stage %d, world %d, %s, %d params", self.path, self.stage, self.world,
                  self.precision, len(self.params))

    def _load(self, file: Path) -> Any:
        """One file of the tag folder, parsed (ds_pickle); a file leading outside the folder is refused."""
        return ds_pickle.load(inside(self.path, file))

    def _count(self, m: dict, key: str, default: int = 0, **kw: Any) -> int:
        """The model-states file's int field `key` (`default` where absent), checked (fz/ckpt/deepspeed/fields.py)."""
        return fields.optional(m.get(key), default, self._model_file, key, **kw)

    def _fields(self, m: dict) -> None:
        """The model-states file's own fields (the step, the config, the buffers...)."""
        file = self._model_file
        dims = fields.mapping(m.get("checkpoint_parallel_dimensions"), file, "checkpoint_parallel_dimensions") or {}
        degrees = [fields.optional(v, 1, file, f"checkpoint_parallel_dimensions[{k!r}]", lo=1) for k, v in dims.items()]
        if self._count(m, "mp_world_size", 1, lo=1) > 1 or any(d > 1 for d in degrees):
            raise CheckpointError(f"{file} was written with model or pipeline parallelism "
                                  f"(mp_world_size={m.get('mp_world_size')}, {dims}): not supported")
        cfg = m.get("ds_config")
        self.ds_config: dict | None = cfg if isinstance(cfg, dict) else None
        self.global_steps = self._count(m, "global_steps")
        self.global_samples = self._count(m, "global_samples")
        self.skipped_steps = self._count(m, "skipped_steps")
        self.lr_scheduler: dict | None = self._scheduler(m.get("lr_scheduler"))
        storages: dict = {}
        self.client_state: dict = {k: None if k == _FROZEN_COPY else ds_pickle.plain(v, False, storages)
                                   for k, v in m.items() if k not in _LOADED}
        self.ds_version: str | None = m.get("ds_version")
        self.world = self._count(m, "dp_world_size", 1, lo=1)
        listed = m.get("buffer_names") or []
        if not isinstance(listed, list | tuple):
            raise CheckpointError(f"DeepSpeed checkpoint file {file}: its buffer_names is {fields.short(listed)}, "
                                  "not a list of names: damaged or not written by DeepSpeed")
        names = [str(n) for n in listed]
        self.buffers: dict[str, torch.Tensor] = {n: ds_pickle.materialize(self._module[n]) for n in names
                                                 if isinstance(self._module.get(n), Lazy)}
        self.params: dict[str, tuple[int, ...]] = {}
        self.frozen: dict[str, tuple[int, ...]] = {}
        self.shared: dict[str, str] = fields.aliases(m.get("shared_params"), file)
        self.moments: tuple[str, ...] = ()
        self.optimizer_step: int | None = None
        self.loss_scaler: dict | None = None
        self._pieces: dict[str, dict[str, list[Piece]]] = {}  # kind -> name -> pieces
        self._universal = (self.path / "zero").is_dir()
        prefix, optim = ds_files.optim_files(self.path)
        self._optim = (prefix, optim) if optim else None
        zero = fields.mapping((self.ds_config or {}).get("zero_optimization"), file, "ds_config zero_optimization")
        self.stage = fields.integer((zero or {}).get("stage", 0), file, "ds_config zero_optimization stage", hi=3)
        self.precision = self._precision(prefix)
        self._scaler_file = file

    def _scheduler(self, sched: Any) -> dict | None:
        """The lr scheduler's state_dict (None when the run had none); its last_batch_iteration
        (-1 before the first step) sets the lr schedule's count on import."""
        sched = fields.mapping(ds_pickle.plain(sched), self._model_file, "lr_scheduler")
        if sched is not None and "last_batch_iteration" in sched:
            fields.integer(sched["last_batch_iteration"], self._model_file, "lr_scheduler last_batch_iteration",
                           lo=-1, hi=MAX_STEPS - 1)
        return sched

    def _precision(self, prefix: str) -> str:
        cfg = self.ds_config or {}
        for p in ("bf16", "fp16"):
            if (cfg.get(p) or {}).get("enabled") or (p == "bf16" and (cfg.get("bfloat16") or {}).get("enabled")):
                return p
        return prefix.rstrip("_") or "fp32"

    def _shape_of(self, name: str) -> tuple[int, ...]:
        return self.params[name] if name in self.params else self.frozen[name]

    # --- layouts -------------------------------------------------------------------------------------------
    def _read_zero(self, prefix: str, optim: dict[int, Path]) -> None:
        first = ds_files.need(self.path, [ds_files.optim_name(prefix, 0)], "rank 0's optimizer states")[0]
        top0 = self._load(first)
        osd0 = top0["optimizer_state_dict"]
        count = osd0.get("partition_count", len(optim))
        counts = count if isinstance(count, list) and count else [count]
        self.world = max(fields.integer(c, first, "partition_count", lo=1) for c in counts)
        self._counted = f"{first}'s partition_count says"
        files = ds_files.ranks(self.path, optim, self.world, lambda r: ds_files.optim_name(prefix, r), self._counted)
        tops = [top0] + [self._load(f) for f in files[1:]]
        ds_ranks.same_run([self._model_file, first], [ds_ranks.model(self._m), ds_ranks.optim(top0, first)])
        ds_ranks.same_run(files, [ds_ranks.optim(t, f) for t, f in zip(tops, files)])
        osds = [t["optimizer_state_dict"] for t in tops]
        self.loss_scaler = fields.mapping(ds_pickle.plain(osd0.get("loss_scaler")), first, "loss_scaler")
        self._scaler_file = first
        if "zero_stage" not in osd0:  # BF16_Optimizer (bf16 without ZeRO): fragments named per rank
            self.stage = 0
            return self._read_bf16_optimizer(osds, files)
        self.stage = fields.integer(osd0["zero_stage"], first, "zero_stage", hi=3)
        shapes = fields.param_shapes(self._m["param_shapes"], self._model_file)
        self.params = {k: v for g in shapes for k, v in g.items()}
        if self.stage == 3:
            inner = [o["optimizer_state_dict"]["state"] for o in osds]
            self._pieces["fp32"] = ds_layout.zero3(shapes, [o["fp32_flat_groups"] for o in osds])
            self._moments(inner, lambda groups: ds_layout.zero3(shapes, groups), first)
            self._frozen_zero3()
            return
        fp32 = [o["single_partition_of_fp32_groups"] for o in osds]
        pads = fields.paddings(osd0.get("group_paddings"), len(fp32[0]), first)
        partition = [t.numel + p for t, p in zip(fp32[0], pads)]
        paddings = osd0.get("param_alignment_paddings")
        self._pieces["fp32"] = ds_layout.zero12(shapes, paddings, fp32, partition)
        base = [o["base_optimizer_state"] for o in osds]
        states = [b["state"] if isinstance(b, dict) else dict(enumerate(b)) for b in base]
        self._moments(states, lambda groups: ds_layout.zero12(shapes, paddings, groups, partition), first)
        self._frozen_module(self._m.get("frozen_param_fragments"))

    def _step(self, state: dict, file: Path) -> int | None:
        """Adam's step (a float tensor DeepSpeed saves, of an integer >= 0), None when not kept."""
        if "step" not in state:
            return None
        return fields.integer(ds_pickle.plain(state["step"]), file, "Adam step", floats=True)

    def _moments(self, states: list[dict], layout: Any, file: Path) -> None:
        """Adam's moments and step from per-rank optimizer `state` dicts keyed by group (or
        sub-group); `file` holds rank 0's."""
        if not states[0]:
            return
        first = next(iter(states[0].values()))
        self.moments = tuple(k for k in _MOMENTS if isinstance(first.get(k), Lazy))
        for kind in self.moments:
            groups = [[s[g][kind] for g in sorted(s)] for s in states]
            self._pieces[kind] = layout(groups)
        self.optimizer_step = self._step(first, file)

    def _frozen_module(self, fragments: dict | None) -> None:
        """Frozen params stored whole: `frozen_param_fragments` (ZeRO 2) or else the module's
        tensors that are neither trainable, buffers nor tied aliases (ZeRO 1, stage 0)."""
        shapes = self._m.get("frozen_param_shapes")
        if fragments:
            for name, t in fragments.items():
                self.frozen[str(name)] = self._frozen_shape(shapes, name) if shapes else t.shape
                self._pieces.setdefault("fp32", {})[str(name)] = ds_layout.whole(t)
            return
        held = {(t.at, t.offset) for n in self.params for t in [self._module.get(n)] if isinstance(t, Lazy)}
        for name, t in self._module.items():
            if (name in self.params or name in self.buffers or name in self.shared or not isinstance(t, Lazy)
                    or (t.at, t.offset) in held):
                continue
            self.frozen[name] = t.shape
            self._pieces.setdefault("fp32", {})[name] = ds_layout.whole(t)

    def _frozen_zero3(self) -> None:
        shapes = self._m.get("frozen_param_shapes") or {}
        if not shapes:
            return
        files = ds_files.ranks(self.path, ds_files.zero3_model_files(self.path), self.world,
                               ds_files.zero3_model_name, self._counted)
        models = [self._m] + [self._load(f) for f in files[1:]]
        ds_ranks.same_run(files, [ds_ranks.model(m) for m in models])
        frags = [m["frozen_param_fragments"] for m in models]
        for name in shapes:
            shape = self.frozen[str(name)] = self._frozen_shape(shapes, name)
            pieces = ds_layout.fragments([f[name] for f in frags], math.prod(shape))
            self._pieces.setdefault("fp32", {})[str(name)] = pieces

    def _frozen_shape(self, shapes: dict, name: Any) -> tuple[int, ...]:
        return fields.shape(shapes[name], self._model_file, f"frozen_param_shapes[{name!r}]")

    def _read_bf16_optimizer(self, osds: list[dict], files: list[Path]) -> None:
        def span(a: DSObject, file: Path, name: str) -> tuple[int, int]:
            start, numel = (fields.integer(a.state[k], file, f"param_slice_mappings[{name!r}] {k}")
                            for k in ("start", "numel"))
            return start, numel

        maps = [[{str(n): span(a, f, str(n)) for n, a in g.items()} for g in o["param_slice_mappings"]]
                for o, f in zip(osds, files)]
        fp32 = [o["single_partition_of_fp32_groups"] for o in osds]
        self._pieces["fp32"] = ds_layout.slice_mappings(maps, fp32)
        self.params = {n: self._module[n].shape for n in self._pieces["fp32"]}
        base = [o["base_optimizer_state"] for o in osds]
        states = [b["state"] if isinstance(b, dict) else dict(enumerate(b)) for b in base]
        self._moments(states, lambda groups: ds_layout.slice_mappings(maps, groups), files[0])
        self._frozen_module(None)

    def _read_stage0(self) -> None:
        """No ZeRO: masters in the model states (`module` for fp32; `fp32_groups` of DeepSpeed's
        unfused fp16/bf16 optimizer), moments in its torch optimizer state_dict."""
        opt = self._m.get("optimizer")
        self.stage = 0
        if isinstance(opt, dict) and "fp32_groups" in opt:
            groups = [list(g) for g in opt["fp32_groups"]]
            torch_sd = opt.get("optimizer_state_dict") or {}
            self.loss_scaler = {"cur_scale": opt.get("cur_scale"), "dynamic": opt.get("dynamic_loss_scale")}
            self._scaler_file = self._model_file
        elif isinstance(opt, dict) and ("fp32_groups_flat" in opt or "single_partition_of_fp32_groups" in opt):
            raise CheckpointError(f"{self._model_file}: a stage-0 {self.precision} optimizer with flat fp32 groups "
                                  "(DeepSpeed's fused FP16_Optimizer): not supported")
        else:
            groups, torch_sd = [], opt if isinstance(opt, dict) else {}
        state = torch_sd.get("state") or {}
        ids = [list(g["params"]) for g in torch_sd.get("param_groups") or []]
        shapes = [[t.shape for t in g] for g in groups] or \
            [[state[i]["exp_avg"].shape if i in state else None for i in g] for g in ids]
        names, placed = ds_match.stage0_names(self._module, set(self.buffers), shapes, groups, self._trainable,
                                              self._model_file)
        masters = [t for g in groups for t in g]
        for i, name in enumerate(names):
            self.params[name] = self._module[name].shape
            self._pieces.setdefault("fp32", {})[name] = ds_layout.whole(masters[i] if masters else self._module[name])
        order = [i for g in ids for i in g]
        first = state.get(order[0]) if order else None
        if first and not placed:
            self.unplaced = (f"{self._model_file}: the optimizer's {len(names)} parameters fit the module's tensors in "
                             "more than one way by shape, and a stage-0 file does not name them, so their Adam moments "
                             "cannot be placed (the weights are named, and read)")
        elif first:
            self.moments = tuple(k for k in _MOMENTS if isinstance(first.get(k), Lazy))
            for kind in self.moments:
                self._pieces[kind] = {n: ds_layout.whole(state[order[i]][kind]) for i, n in enumerate(names)}
        if first:
            self.optimizer_step = self._step(first, self._model_file)
        self._frozen_module(None)

    def _read_universal(self) -> None:
        """ds_to_universal's zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt, one file per tensor, and
        zero/optimizer_state.pt (the loss scaler; from ZeRO-3, Adam's step: it writes no step.pt)."""
        shapes = self._m.get("param_shapes")
        zero = self.path / "zero"
        if shapes:
            self.params = {k: v for g in fields.param_shapes(shapes, self._model_file) for k, v in g.items()}
        else:
            self.params = {p.name: self._load(p / "fp32.pt")["param"].shape for p in sorted(zero.iterdir())}
        for name in self.params:
            if name in ("", ".", "..") or Path(name).name != name:
                raise CheckpointError(f"{self._model_file} names a parameter {name!r}, which is not a folder name of "
                                      f"{zero}: not read")
            ds_files.need(zero / name, ["fp32.pt"], f"the universal checkpoint's master of {name}")
        some = zero / next(iter(self.params))
        self.moments = tuple(k for k in _MOMENTS if (some / f"{k}.pt").is_file())
        if (some / "step.pt").is_file():
            step = ds_pickle.plain(self._load(some / "step.pt"))
            self.optimizer_step = fields.integer(step, some / "step.pt", "Adam step", floats=True)
        if (zero / "optimizer_state.pt").is_file():
            self._universal_state(zero / "optimizer_state.pt")
        if self.stage == 3 and len(ds_files.zero3_model_files(self.path)) > 1:  # frozen ones: in each rank's file
            self._counted = f"{self._model_file}'s dp_world_size says"
            self._frozen_zero3()
        else:
            self._frozen_module(self._m.get("frozen_param_fragments"))

    def _universal_state(self, file: Path) -> None:
        """The optimizer's global state ds_to_universal keeps: the loss scaler, and (ZeRO-3) Adam's
        step in its first sub-group's state, where DeepSpeed reads it."""
        osd = fields.mapping(self._load(file), file, "optimizer state") or {}
        self.loss_scaler = fields.mapping(ds_pickle.plain(osd.get("loss_scaler")), file, "loss_scaler")
        self._scaler_file = file
        inner = fields.mapping(osd.get("optimizer_state_dict"), file, "optimizer_state_dict") or {}
        state = fields.mapping(inner.get("state"), file, "optimizer_state_dict state") or {}
        first = state.get(0)
        if self.optimizer_step is None and isinstance(first, dict):
            self.optimizer_step = self._step(first, file)

    def _tied(self) -> None:
        """Tied aliases ZeRO-3 (and stage 0) do not list in shared_params: module entries stored
        in the same storage as a parameter."""
        def where(t: Lazy) -> tuple:
            return t.at, t.offset, t.shape

        by_storage = {where(self._module[n]): n for n in list(self.params) + list(self.frozen)
                      if isinstance(self._module.get(n), Lazy)}
        for name, t in self._module.items():
            if (name not in self.params and name not in self.frozen and name not in self.buffers
                    and name not in self.shared and isinstance(t, Lazy) and where(t) in by_storage):
                self.shared[name] = by_storage[where(t)]

    # --- values --------------------------------------------------------------------------------------------
    def _pieces_of(self, name: str, kind: str) -> list[Piece]:
        if self._universal and name in self.params:
            f = self.path / "zero" / name / f"{kind}.pt"
            t = self._load(ds_files.need(f.parent, [f.name], f"{kind} of {name}")[0])
            return ds_layout.whole(t["param"] if isinstance(t, dict) else t)
        return self._pieces[kind][name]

    def read(self, name: str, kind: str = "fp32", lo: int = 0,
             hi: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """Elements [lo, hi) of parameter `name`'s flattened fp32 master (kind="fp32") or moment
        (one of `moments`), as (offset, 1-D fp32 tensor) chunks of at most CHUNK_BYTES; reads
        only the bytes needed. Frozen params and tied aliases: kind "fp32"."""
        name = self.shared.get(name, name)
        if name not in self.params and name not in self.frozen:
            raise CheckpointError(f"DeepSpeed checkpoint {self.path} has no parameter {name!r}")
        if kind != "fp32" and (kind not in self.moments or name not in self.params):
            raise CheckpointError(f"DeepSpeed checkpoint {self.path} has no {kind!r} for {name!r} "
                                  f"(moments: {', '.join(self.moments) or 'none'}; frozen params have none)")
        numel = math.prod(self._shape_of(name))
        hi = numel if hi is None else hi
        if not 0 <= lo <= hi <= numel:
            raise CheckpointError(f"read({name!r}, lo={lo}, hi={hi}): the parameter has {numel} elements")
        for p in self._pieces_of(name, kind):
            a, b = max(lo, p.start), min(hi, p.start + p.n)
            if a >= b:
                continue
            src_lo = p.src_start + a - p.start
            step = CHUNK_BYTES * p.src.dtype.itemsize // 4
            for at, chunk in ds_pickle.read(p.src, src_lo, src_lo + b - a, step):
                yield p.start + at - p.src_start, chunk.float()

    def close(self) -> None:
        """Nothing stays open between reads (each opens, preads and closes its file)."""

    def __enter__(self) -> DeepSpeedCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
