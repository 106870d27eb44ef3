"""A ZeRO-3 DeepSpeed checkpoint of any size, in DeepSpeed's exact file layout, without DeepSpeed.

For memory tests and benchmarks of models too large to train here. `write(tag_dir, params, world)`
writes what `engine.save_checkpoint` writes at stage 3 (fp32, AdamW): per rank
`zero_pp_rank_R_mp_rank_00_model_states.pt` (empty module tensors, param_shapes, frozen
fragments, buffers) and `zero_pp_rank_R_mp_rank_00_optim_states.pt` (ZeroStageEnum, LossScaler,
per-sub-group fp32 partitions and Adam moments carrying their ds_id), pickled with the same
globals and opcodes (test_ds_peak.py checks the structure against a real fixture). The large
tensors are backed by files (`torch.from_file`), so writing never holds a rank's partition in
memory. Values are `value(kind, j, e)` for element e of parameter j: checkable without a copy.
"""
from __future__ import annotations

import collections
import functools
import io
import math
import pickle
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

KINDS = ("fp32", "exp_avg", "exp_avg_sq")
_CHUNK = 1 << 22


def value(kind: str, j: int, e: torch.Tensor) -> torch.Tensor:
    """Element values of parameter j (e: element indices); exp_avg_sq's are >= 0, as a mean of
    squares is (fz.import_deepspeed refuses a negative one)."""
    k = KINDS.index(kind)
    v = ((e % 1009).float() + j * 0.25) * (0.001 if k == 0 else 1e-4 * k) - 0.3
    return v.abs() if kind == "exp_avg_sq" else v


class _Global:
    def __init__(self, module: str, name: str):
        self.line = f"{module}\n{name}\n".encode()


class _Enum:
    """Pickles as DeepSpeed's ZeroStageEnum(value): GLOBAL, (value,), REDUCE."""

    def __init__(self, v: int):
        self.v = v


class Raw:
    """Opcodes written as they are (for crafted files: tests/support/ds_hostile.py); they must push one value."""

    def __init__(self, ops: bytes):
        self.ops = ops


class _Obj:
    """Pickles as a DeepSpeed object without __reduce__: GLOBAL, (), NEWOBJ, state, BUILD."""

    def __init__(self, cls: _Global, state: dict):
        self.cls, self.state = cls, state


_STAGE = _Global("deepspeed.runtime.zero.config", "ZeroStageEnum")
_SCALER = _Global("deepspeed.runtime.fp16.loss_scaler", "LossScaler")


class _Pickler(pickle._Pickler):  # type: ignore[name-defined,misc]  # the Python pickler: save() overridable
    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, _Enum):
            self.write(pickle.GLOBAL + _STAGE.line)
            self.save((obj.v,))
            self.write(pickle.REDUCE)
        elif isinstance(obj, _Obj):
            self.write(pickle.GLOBAL + obj.cls.line + pickle.EMPTY_TUPLE + pickle.NEWOBJ)
            self.save(obj.state)
            self.write(pickle.BUILD)
        elif isinstance(obj, Raw):
            self.write(obj.ops)
        else:
            super().save(obj, save_persistent_id)


_MODULE = SimpleNamespace(Pickler=_Pickler, __name__="pickle")


def _backed(scratch: Path, numel: int, fill: Any) -> torch.Tensor:
    """A float32 tensor of `numel` backed by the file `scratch`, written chunk by chunk by `fill(lo, hi)`."""
    with open(scratch, "wb") as f:
        for lo in range(0, numel, _CHUNK):
            f.write(fill(lo, min(numel, lo + _CHUNK)).numpy().tobytes())
    return torch.from_file(str(scratch), shared=False, size=numel, dtype=torch.float32)


def sub_groups(params: Sequence[tuple[str, tuple[int, ...]]], world: int, size: int) -> list[list[int]]:
    """DeepSpeed's sub-groups (stage3.py _create_fp16_sub_groups): consecutive params, a group
    closed once its partition reaches `size` elements."""
    out: list[list[int]] = []
    group: list[int] = []
    at = 0
    for j, (_, shape) in enumerate(params):
        group.append(j)
        at += math.ceil(math.prod(shape) / world)
        if at >= size or j == len(params) - 1:
            out.append(group)
            group, at = [], 0
    return out


def write(tag_dir: Path, params: Sequence[tuple[str, tuple[int, ...]]], world: int = 2, *,
          frozen: Sequence[tuple[str, tuple[int, ...]]] = (), tied: dict[str, str] | None = None,
          sub_group_size: int = 10**9, step: int = 3,
          scratch: Path | None = None, patch: Callable[[str, int, dict], None] | None = None) -> None:
    """A stage-3 fp32 checkpoint of `params` at `world` ranks into `tag_dir` (its parent gets `latest`);
    `tied` {alias: param}: module entries sharing a parameter's (empty) tensor, as ZeRO-3 saves them;
    `patch(kind, rank, obj)` may change each file's object ("model" or "optim") before it is saved."""
    tag_dir.mkdir(parents=True, exist_ok=True)
    (tag_dir.parent / "latest").write_text(tag_dir.name)
    scratch = scratch or tag_dir
    groups = sub_groups(params, world, sub_group_size)
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "sub_group_size": sub_group_size},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}}
    shapes = collections.OrderedDict((n, torch.Size(s)) for n, s in params)
    for r in range(world):
        module = collections.OrderedDict([("scale", torch.linspace(0.5, 1.5, 8))])
        module.update((n, torch.empty(0)) for n, _ in [*params, *frozen])
        module.update((alias, module[name]) for alias, name in (tied or {}).items())
        frags = collections.OrderedDict()
        for n, s in frozen:
            c = math.ceil(math.prod(s) / world)
            e = torch.arange(r * c, r * c + c)
            frags[n] = torch.where(e < math.prod(s), value("fp32", -1, e), 0.0)
        model = {"module": module, "buffer_names": ["scale"], "optimizer": None, "param_shapes": [shapes],
                 "frozen_param_shapes": collections.OrderedDict((n, torch.Size(s)) for n, s in frozen),
                 "shared_params": dict(tied or {}) if r == 0 else {},  # DeepSpeed 0.19 lists them on rank 0 only
                 "frozen_param_fragments": frags,
                 "lr_scheduler": {"last_batch_iteration": step - 1}, "data_sampler": None, "random_ltd": None,
                 "skipped_steps": 0, "global_steps": step, "global_samples": step * world, "dp_world_size": world,
                 "mp_world_size": 1, "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
                 "ds_config": cfg, "ds_version": "0.19.8", "step": step}
        if patch is not None:
            patch("model", r, model)
        torch.save(model, tag_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", pickle_module=_MODULE)
        flats: dict[str, list[torch.Tensor]] = {k: [] for k in KINDS}
        for g, members in enumerate(groups):
            numel = sum(math.ceil(math.prod(params[j][1]) / world) for j in members)
            for kind in KINDS:
                fill = functools.partial(_fill, params, members, world, r, kind)
                t = _backed(scratch / f".synth-{r}-{g}-{kind}", numel, fill)
                t.ds_id = f"{g}_{r}"  # DeepSpeed's flat groups carry attributes: pickled by _rebuild_from_type_v2
                flats[kind].append(t)
        state = {g: {"step": torch.tensor(float(step)), "exp_avg": flats["exp_avg"][g],
                     "exp_avg_sq": flats["exp_avg_sq"][g]} for g in range(len(groups))}
        group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
                 "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                 "decoupled_weight_decay": True, "params": list(range(len(groups)))}
        osd = {"zero_stage": _Enum(3), "loss_scaler": _Obj(_SCALER, {"cur_scale": 1.0, "dynamic": False}),
               "dynamic_loss_scale": False, "overflow": False, "partition_count": world,
               "optimizer_state_dict": {"state": state, "param_groups": [group]}, "fp32_flat_groups": flats["fp32"]}
        top = {"optimizer_state_dict": osd, "ds_config": cfg, "ds_version": "0.19.8"}
        if patch is not None:
            patch("optim", r, top)
        torch.save(top, tag_dir / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", pickle_module=_MODULE)
        del flats, state, osd, top
        for f in scratch.glob(f".synth-{r}-*"):
            f.unlink()


def _fill(params: Sequence[tuple[str, tuple[int, ...]]], members: list[int], world: int, r: int, kind: str,
          lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of rank r's flat partition of the sub-group `members` (padding: 0)."""
    out = torch.zeros(hi - lo)
    at = 0
    for j in members:
        numel = math.prod(params[j][1])
        c = math.ceil(numel / world)
        a, b = max(lo, at), min(hi, at + c)
        if a < b:
            e = torch.arange(a - at, b - at) + r * c
            out[a - lo:b - lo] = torch.where(e < numel, value(kind, j, e), 0.0)
        at += c
    return out


def pickled(obj: Any) -> bytes:
    """`obj` as this writer pickles it (for tests of the opcodes)."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()
