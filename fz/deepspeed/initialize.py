"""`deepspeed.initialize`, `add_config_arguments`, `init_distributed`, as DeepSpeed's scripts call them.

initialize reads the DeepSpeed config (`config=` / `config_params=`, or `args.deepspeed_config`)
into an fz.Spec (fz/config: every key honoured or reported), the client's optimizer and lr
scheduler into fz.optim (fz/optim/from_torch.py), makes the State with fz.init, and
returns DeepSpeed's four: (engine, optimizer, dataloader, lr_scheduler). The data loader is
DeepSpeed's: a DistributedSampler (shuffled, seed 0, the same order every epoch) over this
rank's micro-batches, so a script sees the batches it saw under DeepSpeed.
"""
from __future__ import annotations

import argparse
import copy
import inspect
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import fz
from fz.config.deepspeed import load as load_config
from fz.config.warn import DeepSpeedConfigWarning
from fz.deepspeed.engine import DeepSpeedEngine
from fz.errors import ConfigError
from fz.optim.from_torch import ClientOptimizer, client_optimizer, client_schedule


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line arguments: --deepspeed, --deepspeed_config (and the old --deepscale ones)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def init_distributed(dist_backend: str | None = None, **kwargs: Any) -> None:
    """Start the process group from the launcher's environment (fz run, deepspeed, torchrun)."""
    fz.distributed.init(dist_backend)


class EngineDataLoader:
    """DeepSpeed's DeepSpeedDataLoader: this rank's micro-batches, in DistributedSampler's order."""

    def __init__(self, dataset: Any, batch_size: int, rank: int, world: int,
                 collate_fn: Callable | None, drop_last: bool):
        self.dataset, self.batch_size, self.collate_fn, self.drop_last = dataset, batch_size, collate_fn, drop_last
        self.data_sampler: DistributedSampler = DistributedSampler(dataset, num_replicas=world, rank=rank)
        n = len(self.data_sampler)
        self.len = n // batch_size if drop_last else -(-n // batch_size)
        self.data: Any = None

    def __iter__(self) -> EngineDataLoader:
        self.data = iter(DataLoader(self.dataset, batch_size=self.batch_size, sampler=self.data_sampler,
                                    collate_fn=self.collate_fn, drop_last=self.drop_last))
        return self

    def __next__(self) -> Any:
        if self.data is None:
            iter(self)
        return next(self.data)

    def __len__(self) -> int:
        return self.len


def _config(args: Any, config: Any, config_params: Any) -> Any:
    if config is not None and config_params is not None:
        raise ConfigError("deepspeed.initialize: give config= or config_params=, not both")
    config = config if config is not None else config_params
    from_args = None
    for key in ("deepspeed_config", "deepscale_config"):
        if args is not None and getattr(args, key, None) is not None:
            from_args = getattr(args, key)
    if from_args is not None and config is not None:
        raise ConfigError("deepspeed.initialize: a config in both args.deepspeed_config and config=; give one, "
                          "as DeepSpeed requires")
    config = config if config is not None else from_args
    if config is None:
        raise ConfigError("deepspeed.initialize needs a DeepSpeed config: config= (a dict or a JSON path), or "
                          "--deepspeed_config on the command line (deepspeed.add_config_arguments)")
    return config


def _drop(cfg: dict[str, Any], key: str, why: str) -> None:
    if cfg.pop(key, None):
        warnings.warn(f"deepspeed.initialize: the config's {key!r} section is not used: {why}, as in DeepSpeed",
                      DeepSpeedConfigWarning, stacklevel=3)


def _group_settings(chosen: ClientOptimizer | None, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Each parameter group's settings besides the lr, as DeepSpeed's optimizer's param_groups
    hold them: the client's (or the groups') optimizer, else the config's section."""
    if isinstance(chosen, ClientOptimizer):
        if chosen.kind == "sgd":
            base: dict[str, Any] = {"momentum": chosen.momentum, "dampening": 0.0, "nesterov": chosen.nesterov}
        else:
            base = {"betas": tuple(chosen.betas), "eps": chosen.eps, "bias_correction": True}
        members = chosen.members or ((),)
        return [{**base, "weight_decay": chosen.weight_decay if chosen.decay is None or any(
            n in chosen.decay for n in names) else 0.0} for names in members]
    section = cfg.get("optimizer") or {}
    given = {k: v for k, v in (section.get("params") or {}).items() if v != "auto"}
    if str(section.get("type", "")).lower() == "sgd":
        return [{"momentum": given.get("momentum", 0.0), "dampening": given.get("dampening", 0.0),
                 "nesterov": given.get("nesterov", False), "weight_decay": given.get("weight_decay", 0.0)}]
    return [{"betas": tuple(given.get("betas", (0.9, 0.999))), "eps": given.get("eps", 1e-8),
             "weight_decay": given.get("weight_decay", 0.0), "bias_correction": given.get("bias_correction", True)}]


_TORCH_KINDS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def _grouped(cfg: dict[str, Any], model_parameters: Iterable[Any] | None, model: nn.Module) -> ClientOptimizer | None:
    """Param groups given with a config optimizer (the "no decay for biases and norms" groups): the
    config's optimizer with the groups' settings over its own, as torch and DeepSpeed build it (a
    group's weight_decay a mask; settings fz cannot honour per group refused by client_optimizer);
    None when the groups change nothing."""
    section = cfg.get("optimizer")
    if not section:  # groups without an optimizer: DeepSpeed's engine is then for inference, as without groups
        return None
    params = dict(section.get("params") or {})
    for key in ("lr", "weight_decay", "eps"):
        if params.get(key) == "auto":
            raise ConfigError(f'the config\'s optimizer.params.{key} is "auto": deepspeed.initialize has no '
                              f"Trainer to fill it (as in DeepSpeed): give the number")
    items = list(model_parameters) if model_parameters is not None else []
    if not items or not isinstance(items[0], dict):
        return None
    kind = str(section.get("type", "adamw")).lower()
    if kind == "adam" and bool(params.get("adam_w_mode", True)):
        kind = "adamw"  # DeepSpeed's Adam decouples the decay unless adam_w_mode is false
    if kind not in _TORCH_KINDS:
        raise ConfigError(f"deepspeed.initialize(model_parameters=groups) with optimizer.type {kind!r}: fz reads "
                          "parameter groups for Adam, AdamW and SGD; pass one group (model.parameters())")
    cls = _TORCH_KINDS[kind]
    accepted = set(inspect.signature(cls).parameters) - {"params", "amsgrad", "foreach", "fused", "capturable",
                                                          "differentiable", "maximize"}
    defaults = {k: tuple(v) if k == "betas" else v for k, v in params.items() if k in accepted}
    defaults.setdefault("lr", 1e-3)
    if cls is torch.optim.AdamW:
        defaults.setdefault("weight_decay", 0.0)  # DeepSpeed's default, not torch's 0.01
    stand_in = cls([dict(g) for g in items], **defaults)  # a group's own settings over the config's
    changed = any(g.get(k) != stand_in.defaults.get(k) for g in stand_in.param_groups for k in g if k != "params")
    covered = len(stand_in.param_groups[0]["params"]) == sum(1 for p in model.parameters() if p.requires_grad)
    if not changed and covered:
        return None
    return client_optimizer(stand_in, model, ("deepspeed.initialize(model_parameters=groups)",
                                              "give every group the config's lr"))


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable[Any] | None = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int | None = None, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable | None = None, config: Any = None, config_params: Any = None,
               mesh_param: Any = None) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """(engine, optimizer, training_dataloader, lr_scheduler), as DeepSpeed's initialize returns
    them; the engine's `state` is the fz.State its updates replace."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"deepspeed.initialize needs model= (an nn.Module), got {type(model).__name__}")
    if mpu is not None or mesh_param is not None:
        raise ConfigError("deepspeed.initialize(mpu=/mesh_param=): model (tensor/pipeline) parallelism is not "
                          "supported by fz, which is data parallel (ZeRO)")
    if dist_init_required is not False:
        fz.distributed.init()
    given = _config(args, config, config_params)
    cfg, _ = load_config(given)
    cfg = dict(cfg)
    # DeepSpeed's engine.config, as load_checkpoint returns it (ds_config): a path as given, a dict before fz's edits
    given = given if isinstance(given, str | os.PathLike) else copy.deepcopy(cfg)
    if cfg.get("train_batch_size") is None and cfg.get("train_micro_batch_size_per_gpu") is None:
        raise ConfigError("the DeepSpeed config sets neither train_batch_size nor train_micro_batch_size_per_gpu: "
                          "give one (DeepSpeed refuses this config too)")
    auto: dict[str, Any] = {}
    torch_opt = None
    if optimizer is not None:
        torch_opt = optimizer(model_parameters if model_parameters is not None else model.parameters()) \
            if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer) else optimizer
        client = client_optimizer(torch_opt, model)
        _drop(cfg, "optimizer", "initialize was given optimizer=, which wins")
        auto.update(optimizer=client, lr=client.lr)
    else:
        grouped = _grouped(cfg, model_parameters, model)
        if grouped is not None:
            cfg.pop("optimizer", None)  # read into `grouped`, with the groups' mask
            auto.update(optimizer=grouped, lr=grouped.lr)
    trains = bool(auto.get("optimizer") or cfg.get("optimizer"))
    if not trains:  # DeepSpeed's engine without an optimizer: inference (ZeRO-3 sharded), backward refused
        auto.update(optimizer=ClientOptimizer("sgd", 0.0), lr=0.0)  # stateless: no memory for moments
    if lr_scheduler is not None:
        stand_in = torch_opt
        if stand_in is None:
            lr = float(auto.get("lr", ((cfg.get("optimizer") or {}).get("params") or {}).get("lr", 1e-3)))
            stand_in = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=lr)
        client_lrs = client_schedule(lr_scheduler, stand_in)
        _drop(cfg, "scheduler", "initialize was given lr_scheduler=, which wins")
        auto["schedule"] = lambda lr: client_lrs
    spec = fz.Spec.from_deepspeed(cfg, **auto).replace(buffer_sync="local")  # DeepSpeed syncs no module buffer
    state = fz.init(model, spec)
    schedule = spec.provenance.objects.get("lr") if spec.provenance is not None else None
    chosen = auto.get("optimizer")
    groups = chosen.members if isinstance(chosen, ClientOptimizer) and chosen.groups > 1 else ()
    loader = None
    if training_data is not None:
        loader = EngineDataLoader(training_data, int(spec.micro_batch or 1), state.plan.rank, len(state.plan.ranks),
                                  collate_fn, bool(cfg.get("dataloader_drop_last", False)))
    engine = DeepSpeedEngine(model, state, schedule=schedule, groups=groups, dataloader=loader, config=cfg,
                             given_config=given, trains=trains, settings=_group_settings(chosen, cfg))
    if not (lr_scheduler is not None or cfg.get("scheduler")):
        engine.lr_scheduler = None  # DeepSpeed's engine has none either (its lr stays the optimizer's)
    return engine, engine.optimizer if trains else None, loader, engine.lr_scheduler
