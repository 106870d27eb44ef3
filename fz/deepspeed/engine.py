"""DeepSpeed's engine, as a thin imperative shell over an fz State.

    loss = engine(batch); engine.backward(loss); engine.step()

is DeepSpeed's loop. The engine holds `engine.state` (an fz.State) and nothing of its own but counters: a
forward in train mode opens a step (fz/step/phases.py: the phases of fz.train_step), backward backpropagates
one micro-batch into it, and `step()` at the accumulation boundary finishes it, replacing `engine.state`. So
the engine's step is fz.train_step's, bit for bit. In eval mode (or under no_grad) a forward is fz.apply.

`engine.module` is the model given to initialize, with the trained weights: they are copied in when it is
read after a step (at stage 3 gathered, so every rank reads it).
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import fz
from fz.config.keys import gathers_16bit_on_save
from fz.deepspeed import model_sync, zero
from fz.deepspeed.engine_info import EngineInfo
from fz.deepspeed.views import EngineOptimizer, EngineSchedule
from fz.errors import CheckpointError, ConfigError, NonFiniteError
from fz.observe.monitor import Monitor, batch_counts
from fz.step import StepInProgress
from fz.step.batches import on_device
from fz.storage.fresh import replacing

log = logging.getLogger(__name__)


class DeepSpeedEngine(EngineInfo):
    """What `deepspeed.initialize` returns first. `engine.state` is the fz State."""

    def __init__(self, model: nn.Module, state: fz.State, *, schedule: Any = None,
                 groups: tuple[tuple[str, ...], ...] = (), dataloader: Any = None,
                 config: dict[str, Any] | None = None, given_config: Any = None, trains: bool = True,
                 settings: list[dict[str, Any]] | None = None):
        """`groups`: the parameter names of each group the script gave (none: one group); `trains`:
        an optimizer was given (without one, as in DeepSpeed, backward is refused: inference);
        `settings`: each group's optimizer settings besides the lr, as its param_groups show them."""
        self.state = state
        self.optimizer = EngineOptimizer(self, max(1, len(groups)), settings)
        self._groups = groups
        self._trains = trains
        self.lr_scheduler: EngineSchedule | None = EngineSchedule(self)
        self.training_dataloader = dataloader
        self.config = dict(config or {})
        self._given_config = self.config if given_config is None else given_config  # DeepSpeed's ds_config
        self._model, self._schedule = model, schedule
        self._step: StepInProgress | None = None
        self._shown_grads: list[nn.Parameter] = []  # the model's parameters given the step's gradients as .grad
        self._synced_step = int(state.step)  # the model holds the weights of this step
        self._syncing = False  # copying between the model and the State (fz/deepspeed/model_sync.py)
        self._watching = model_sync.watch(self, model)  # the script's own `model` follows the State
        self._boundary: bool | None = None
        self.micro_steps = 0
        self.global_samples = 0
        self.training = True
        self.losses: Tensor | None = None  # the last update's loss, averaged over ranks and micro-batches
        # the config's tensorboard / csv_monitor / steps_per_print, as DeepSpeed's engine writes them
        self.monitor = Monitor.from_spec(state.spec)
        self._counted = [0, 0]  # rows and tokens of this step's micro-batches (this rank)
        zero.register(self)  # deepspeed.zero.GatheredParameters finds the engine of a model's parameters
        if state.spec.stage < 3 and state.plan.world > 1:  # fz.init took rank 0's weights: this rank's model too,
            self._synced_step = -1  # as DeepSpeed broadcasts them into the module (a local copy at ZeRO 0-2)
            model_sync.pull(self)

    # ------------------------------------------------------------ what DeepSpeed's engine tells (EngineInfo too)
    def get_lr(self) -> list[float]:
        """The lr of the next update, per parameter group (as DeepSpeed's optimizer holds it)."""
        return [self.lr_at(self._lr_count())] * self.optimizer.groups

    def lr_at(self, count: int) -> float:
        s = self._schedule
        return float(s(count)) if callable(s) else float(s if s is not None else 0.0)

    def _lr_count(self) -> int:
        return self.global_steps - self.skipped_steps

    def get_global_grad_norm(self) -> float | None:
        """The last update's gradient norm before clipping; None where fz computed none (before the
        first update, or without gradient_clipping: fz computes the norm only to clip)."""
        if self.optimizer.overflow:  # DeepSpeed's on a step its overflow skipped
            return math.inf
        norm = self.state.metrics.get("grad_norm")
        return None if norm is None or math.isnan(float(norm)) else float(norm)

    def gradient_clipping(self) -> float:
        return float(self.state.spec.clip_grad_norm or 0.0)

    def get_mom(self) -> list[Any]:
        """Each group's betas (SGD's momentum), as DeepSpeed's engine reads its optimizer's."""
        opt = self.state.spec.optimizer
        if hasattr(opt, "betas"):
            return [tuple(opt.betas)] * self.optimizer.groups
        section = self.config.get("optimizer") or {}
        params = section.get("params") or {}
        if str(section.get("type", "")).lower() in ("sgd", "rmsprop"):
            return [params.get("momentum", 0.0)] * self.optimizer.groups
        return [tuple(params.get("betas", (0.9, 0.999)))] * self.optimizer.groups

    def destroy(self) -> None:
        """The hooks on the script's model go (fz/deepspeed/model_sync.py); the engine holds only its
        State (and no process group of its own)."""
        model_sync.unwatch(self._model, self._watching)
        self._watching = []

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DeepSpeed's no_sync: refused at ZeRO 2-3 (their gradients are partitioned as they are
        reduced), as DeepSpeed refuses it; at 0-1 fz reduces once, at the boundary, already."""
        if self.zero_optimization_stage() >= 2:
            raise ConfigError(f"engine.no_sync() is incompatible with ZeRO stage {self.zero_optimization_stage()}'s "
                              "gradient partitioning (as in DeepSpeed)")
        yield

    def loss_scale(self) -> float:
        """The config's static fp16 loss scale, 0.0 when dynamic (DeepSpeed's engine.loss_scale());
        the scale in use is `cur_scale` (and optimizer.cur_scale)."""
        return float(self.state.spec.loss_scaling.loss_scale) if self.fp16_enabled() else 0.0

    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale() == 0

    @property
    def cur_scale(self) -> float:
        scaler = self.state.scaler or {}
        return float(scaler["scale"]) if "scale" in scaler else 1.0

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary = bool(is_boundary)

    def was_step_applied(self) -> bool:
        return self._applied

    _applied = False

    # ------------------------------------------------------------ modes
    def train(self, mode: bool = True) -> DeepSpeedEngine:
        self.training = bool(mode)
        self._model.train(mode)
        return self

    def eval(self) -> DeepSpeedEngine:
        return self.train(False)

    # ------------------------------------------------------------ the loop
    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.forward(*inputs, **kwargs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The model's forward on this rank's micro-batch. In train mode with grad enabled it is a
        micro-batch of the open step; otherwise fz.apply (no state changes)."""
        inputs, kwargs = on_device((inputs, kwargs), self.device)
        training = self._model.training  # the model's mode: engine.eval(), model.eval(), engine.module.eval()
        if not (training and torch.is_grad_enabled()):
            if self._step is not None:  # inside an accumulation window: on its parameters, none of its micro-batches
                return self._step.forward_aside(lambda model, a, k: model(*a, **k), inputs, kwargs, train=training)
            return fz.apply(self.state, *inputs, train=training, **kwargs)
        if self._step is None:
            self._step = StepInProgress(self.state, (inputs, kwargs), what="engine.forward", process_rng=True)
        rows, tokens = batch_counts((inputs, kwargs))
        self._counted = [self._counted[0] + rows, self._counted[1] + (tokens or 0)]
        return self._step.forward(lambda model, a, k: model(*a, **k), inputs, kwargs)

    def backward(self, loss: Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Tensor:
        """Backpropagate this micro-batch's loss (divided by the accumulation steps, and scaled in
        fp16); gradients are reduced as DeepSpeed's ZeRO stage reduces them."""
        if not self._trains:
            if self._step is not None:
                self._step.abort()
                self._step = None
            raise ConfigError("engine.backward: deepspeed.initialize was given no optimizer (no optimizer= and no "
                              "\"optimizer\" section), so this engine is for inference, as DeepSpeed's (whose backward "
                              "asserts: must provide optimizer during init in order to use backward)")
        if self._step is None:
            raise ConfigError("engine.backward(loss) needs a forward in train mode first (loss = engine(batch))")
        if retain_graph:
            raise ConfigError("engine.backward(retain_graph=True) is not supported by fz: each micro-batch's "
                              "graph is freed as its gradients are reduced")
        given = loss
        if not scale_wrt_gas:
            loss = loss * self.gradient_accumulation_steps()
        model_sync.drop_grads(self)  # views of the step's buffers, which this backward accumulates into
        self._step.backward(loss, last=self.is_gradient_accumulation_boundary())
        model_sync.show_grads(self)  # as DeepSpeed's p.grad (ZeRO 0-1)
        return given / self.gradient_accumulation_steps() if scale_wrt_gas else given  # DeepSpeed's return

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """At the accumulation boundary: the optimizer update (and the lr scheduler's step); else
        only the micro-step count advances, as in DeepSpeed."""
        if lr_kwargs:
            raise ConfigError("engine.step(lr_kwargs=...): fz's lr follows the config's scheduler and takes no "
                              "per-step arguments")
        self._applied = False
        if self.is_gradient_accumulation_boundary():
            if self._step is None:
                raise ConfigError("engine.step() at the accumulation boundary without a backward: call "
                                  "engine(batch) and engine.backward(loss) first")
            model_sync.drop_grads(self)
            step, self._step, skipped = self._step, None, self.skipped_steps
            self.state, self.losses = step.finish()
            self._applied = self.skipped_steps == skipped
            self.optimizer.overflow = not self._applied
            self.global_samples += self.train_batch_size()
            rows, tokens = self._counted
            self._counted = [0, 0]
            self.monitor(self.state, self.losses, rows=rows, tokens=tokens or None)
        self.micro_steps += 1

    def zero_grad(self) -> None:
        """The gradients shown as the model's `.grad` taken off (the step's own go with its update)."""
        model_sync.drop_grads(self)

    # ------------------------------------------------------------ the model
    @property
    def module(self) -> nn.Module:
        """The model, holding the current weights (copied in after a step; at stage 3 gathered,
        so every rank reads it, in step)."""
        model_sync.pull(self)
        return self._model

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any):
        return self.module.named_parameters(*args, **kwargs)

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """The engine's as DeepSpeed's (an nn.Module holding the model as `module`): keys `module.<name>`."""
        return self.module.state_dict(destination=destination, prefix=prefix + "module.", keep_vars=keep_vars)

    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """The model's state_dict, as DeepSpeed's engine gives it (its own names)."""
        out = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            frozen = {prefix + n for n, p in self._model.named_parameters() if not p.requires_grad}
            out = type(out)((k, v) for k, v in out.items() if k not in frozen)
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True) -> Any:
        """engine.state_dict()'s keys (`module.<name>`) into the model, and so into the State."""
        inner = {k.removeprefix("module."): v for k, v in state_dict.items()}
        return self.module.load_state_dict(inner, strict=strict)

    def __getattr__(self, name: str) -> Any:
        """The model's attributes, as DeepSpeed's engine gives them (`engine.config`); a submodule or
        parameter comes from `module` (current weights)."""
        if name.startswith("_") or name in ("state",):
            raise AttributeError(name)
        if not hasattr(self._model, name):  # named as the engine's, not "'Sequential' object has no attribute"
            raise AttributeError(f"fz.deepspeed's engine has no attribute {name!r} (one of DeepSpeed's engine fz "
                                 "does not provide, see docs/deepspeed.md), nor has its model "
                                 f"({type(self._model).__name__})", name=name, obj=self)
        value = getattr(self._model, name)
        if isinstance(value, (nn.Module, nn.Parameter)):
            return getattr(self.module, name)
        return value

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir: str | Path, tag: Any = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        client_sd: dict[str, Any] | None = None) -> bool:
        """`save_dir/<tag>/` (default global_step<N>), an fz checkpoint with `client_state`, in
        DeepSpeed's layout; `latest` names the tag. A tag saved again is replaced, as DeepSpeed
        does. Every rank calls it. `client_sd` is DeepSpeed's tutorial's spelling of
        `client_state`, taken as the same."""
        from fz.deepspeed.checkpoints import save
        if client_sd is not None:
            if client_state:
                raise ConfigError("save_checkpoint: give client_state= or client_sd=, not both")
            client_state = client_sd
        if self._step is not None:
            raise ConfigError("engine.save_checkpoint inside an accumulation window (between engine(batch) and the "
                              "boundary's engine.step()): save after the update")
        if exclude_frozen_parameters:
            log.warning("save_checkpoint(exclude_frozen_parameters=True): fz saves the frozen parameters too (its "
                        "checkpoint holds the whole state, which resumes exactly; DeepSpeed's leaves them out)")
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        save(self.state, Path(save_dir), tag, dict(client_state or {}), self._counters(), save_latest)
        return True

    def load_checkpoint(self, load_dir: str | Path, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[str | None, Any]:
        """(path, client_state) of `load_dir/<tag>` (default: the tag `latest` names), an fz or a
        DeepSpeed checkpoint, restored into the engine's state at this world size and stage;
        (None, None) and a warning (fz's logger) when there is no `latest`, as DeepSpeed does."""
        from fz.deepspeed.checkpoints import ds_fields, load
        from fz.deepspeed.version import __version__
        off = [k for k, v in (("load_optimizer_states", not load_optimizer_states),
                              ("load_lr_scheduler_states", not load_lr_scheduler_states),
                              ("load_module_only", load_module_only), ("custom_load_fn", custom_load_fn)) if v]
        if off:
            raise ConfigError(f"engine.load_checkpoint: {', '.join(off)} other than the default is not supported by "
                              "fz (it restores the whole state); for weights only use fz.load_weights")
        if self._step is not None:
            raise ConfigError("engine.load_checkpoint inside an accumulation window: load before engine(batch)")
        try:
            universal = bool((self.config.get("checkpoint") or {}).get("load_universal"))
            got = load(self.state, Path(load_dir), None if tag is None else str(tag), universal,
                       strict=bool(load_module_strict))
        except (CheckpointError, NonFiniteError) as e:
            if self.state.donated_to:  # filled in part, then refused: the engine has no state left
                raise type(e)(f"{e}\nThe engine's state was loaded into in place and is given up: make the engine "
                              "again with deepspeed.initialize") from e
            raise
        if got is None:
            return None, None
        self.state, path, client_state, counters = got
        self.global_samples = int(counters.get("global_samples", self.global_steps * self.train_batch_size()))
        # micro_steps stays the engine's own count, as DeepSpeed's load leaves it (at a boundary either way)
        self._synced_step = -1
        fields = ds_fields(self._model, self._given_config, self.zero_optimization_stage(), self.global_samples,
                           __version__, self._groups)
        return str(path), {**fields, **client_state}  # a DeepSpeed file's own fields are in its client_state

    def save_16bit_model(self, save_dir: str | Path, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """`save_dir/save_filename`: the model's state_dict in the training precision (bf16/fp16; fp32
        in an fp32 run), as DeepSpeed writes it; at stage 3 only with the config's
        stage3_gather_16bit_weights_on_model_save (else False, as DeepSpeed). Every rank calls it."""
        if self.zero_optimization_stage() == 3 and not gathers_16bit_on_save(self.config):
            log.info("did not save %s: stage3_gather_16bit_weights_on_model_save is false (as DeepSpeed)",
                     os.path.join(str(save_dir), save_filename))
            return False
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(self.state.spec.precision))
        frozen = {n for n, p in self._model.named_parameters() if not p.requires_grad}
        weights = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().clone()
                   for k, v in self.module.state_dict().items()
                   if not (exclude_frozen_parameters and k in frozen)}  # module: gathered on every rank
        if self.global_rank == self.state.plan.ranks[0]:
            os.makedirs(save_dir, exist_ok=True)
            with replacing(os.path.join(str(save_dir), save_filename)) as tmp:  # a planted link is replaced, unfollowed
                torch.save(weights, tmp)
        return True

    def _counters(self) -> dict[str, Any]:
        """The engine's counters, and what zero_to_fp32 gives as DeepSpeed's does (tied aliases, frozen names)."""
        frozen = [n for n, p in nn.Module.named_parameters(self._model) if not p.requires_grad]
        return {"global_samples": self.global_samples, "micro_steps": self.micro_steps,
                "shared_params": dict(self.state.skeleton.aliases), "frozen": frozen}
