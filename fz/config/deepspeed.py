"""`Spec.from_deepspeed`: a DeepSpeed JSON config (dict or path) -> an fz.Spec.

"auto" values are filled from keyword arguments (AUTO_NAMES); the world size comes from
`world_size=` or torch.distributed (else 1). Absent keys take fz's defaults (DeepSpeed's
own defaults for the optimizer's parameters). Everything read is recorded in
`spec.provenance`; `spec.explain()` prints it.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Optional, Tuple, Union

from fz.config import keys as K
from fz.config.explain import Described, Provenance
from fz.config.optimizer import OptimizerConfig, read_scheduler
from fz.config.values import (
    AUTO, Reader, betas, boolean, choice, integer, number, optional, section, string,
)
from fz import optim
from fz.errors import ConfigError, suggest
from fz.precision import LossScale

AUTO_NAMES = ("lr", "betas", "eps", "weight_decay", "micro_batch", "grad_accum", "clip_grad_norm", "precision",
              "total_steps", "warmup_steps")
COUNT = integer(1, 2**62)
ELEMENTS = integer(1, 2**62)
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def load(config: Union[dict, str, os.PathLike]) -> Tuple[Dict[str, Any], str]:
    """The config as a dict, and where it came from (for explain)."""
    if isinstance(config, dict):
        return section("config", config), "a dict"
    if isinstance(config, str) and config.lstrip().startswith("{"):
        text, origin = config, "a JSON string"
    elif isinstance(config, (str, os.PathLike)):
        try:
            with open(config, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read DeepSpeed config {os.fspath(config)!r}: {e.strerror or e}") from None
        origin = repr(os.fspath(config))
    else:
        raise ConfigError(f"Spec.from_deepspeed needs a dict or a path to a JSON file, got {type(config).__name__}")
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"DeepSpeed config {origin} is not valid JSON: {e}") from None
    return section("config", data), origin


def _check_auto(auto: Dict[str, Any]) -> Dict[str, Any]:
    """Keyword arguments are checked like config values; unknown names are errors."""
    checks = {
        "lr": number(0.0), "betas": betas, "eps": number(0.0), "weight_decay": number(0.0),
        "micro_batch": COUNT, "grad_accum": COUNT, "clip_grad_norm": optional(number(0.0, lo_open=True)),
        "precision": choice(("fp32", "bf16", "fp16")), "total_steps": COUNT, "warmup_steps": COUNT,
        "world_size": COUNT,
    }
    out = {}
    for k, v in auto.items():
        if k not in checks:
            raise ConfigError(f"Spec.from_deepspeed: unknown keyword {k!r}{suggest(k, list(checks))}; "
                              f"\"auto\" values are filled from {', '.join(AUTO_NAMES)}; also world_size")
        out[k] = checks[k](k, v)
    return out


def _world_size(auto: Dict[str, Any]) -> Tuple[int, str]:
    from fz.sharding.mesh import user_world_size
    live = user_world_size()
    if "world_size" in auto:
        if live is not None and live != auto["world_size"]:
            raise ConfigError(f"world_size={auto['world_size']} but torch.distributed runs {live} processes")
        return auto["world_size"], "auto"
    return (live, "auto") if live is not None else (1, "default")


def _batch(r: Reader, cfg: Dict[str, Any], world: int) -> Tuple[Optional[int], int]:
    """(micro_batch, grad_accum) from any two of the three sizes: train = micro * accum * world."""
    fill = {"train_batch_size": None, "train_micro_batch_size_per_gpu": "micro_batch",
            "gradient_accumulation_steps": "grad_accum"}
    known: Dict[str, int] = {}
    source: Dict[str, str] = {}
    pending = []
    for key in BATCH_KEYS:
        v = cfg.get(key)
        if isinstance(v, str) and v == AUTO:
            kw = fill[key]
            if kw is not None and kw in r.auto:
                r.used_auto.add(kw)
                known[key], source[key] = r.auto[kw], "auto"
            else:
                pending.append(key)
        elif v is not None:
            known[key], source[key] = COUNT(key, v), "config"
    train, micro, accum = (known.get(k) for k in BATCH_KEYS)
    if len(known) == 3:
        if train != micro * accum * world:
            raise ConfigError(f"train_batch_size={train} != train_micro_batch_size_per_gpu={micro} * "
                              f"gradient_accumulation_steps={accum} * world_size={world} (= {micro * accum * world})")
    elif len(known) == 2:
        derived = "auto" if pending else "config"
        if train is None:
            train = micro * accum * world
            known["train_batch_size"], source["train_batch_size"] = train, derived
        else:
            given_key, other_key = BATCH_KEYS[1:] if accum is None else BATCH_KEYS[:0:-1]
            given = known[given_key]
            if train % (given * world):
                raise ConfigError(f"train_batch_size={train}, {given_key}={given} and world_size={world} give "
                                  f"{other_key}={train / (given * world):g}, not a positive integer "
                                  "(train_batch_size = micro batch * accumulation steps * world size)")
            known[other_key], source[other_key] = train // (given * world), derived
        pending = []
    if pending:
        key = pending[0]
        how = f"pass {fill[key]}=... or " if fill[key] else ""
        raise ConfigError(f'{key}: "auto" is left without a value ({how}give two of {", ".join(BATCH_KEYS)})')
    if len(known) == 1 and train is not None:  # DeepSpeed: accumulation 1, micro = train / world
        if train % world:
            raise ConfigError(f"train_batch_size={train} is not divisible by world_size={world} "
                              "(with gradient_accumulation_steps=1 and train_micro_batch_size_per_gpu unset)")
        known.update(gradient_accumulation_steps=1, train_micro_batch_size_per_gpu=train // world)
        source.update(gradient_accumulation_steps="default", train_micro_batch_size_per_gpu="config")
    elif len(known) == 1 and micro is not None:
        known.update(gradient_accumulation_steps=1, train_batch_size=micro * world)
        source.update(gradient_accumulation_steps="default", train_batch_size="config")
    micro, accum = known.get("train_micro_batch_size_per_gpu"), known.get("gradient_accumulation_steps", 1)
    r.record("micro_batch", micro, source.get("train_micro_batch_size_per_gpu", "default"),
             "train_micro_batch_size_per_gpu")
    r.record("grad_accum", accum, source.get("gradient_accumulation_steps", "default"), "gradient_accumulation_steps")
    if "train_batch_size" in known:
        r.record("train_batch_size", known["train_batch_size"], source["train_batch_size"], "train_batch_size")
    return micro, accum


def _offload(r: Reader, zero: Dict[str, Any], key: str) -> None:
    path = f"zero_optimization.{key}"
    v = zero.get(key)
    if isinstance(v, bool) or v is None:  # older configs: "offload_optimizer": false
        device = "cpu" if v else "none"
    else:
        d = section(path, v)
        r.check_keys(path, d, K.OFFLOAD_KEYS)
        device = choice(K.OFFLOAD_DEVICES)(f"{path}.device", d.get("device", "none"))
    if device != "none":
        r.unsupported.append(f"{path} (device {device!r})")
    elif key in zero:
        r.ignored.append(path)


def _zero(r: Reader, raw: Any, fields: set) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    if isinstance(raw, bool):  # DeepSpeed's deprecated form: true means stage 1
        raw = {"stage": 1 if raw else 0}
    zero = section("zero_optimization", raw if raw is not None else {})
    r.check_keys("zero_optimization", zero, K.ZERO_USED, K.ZERO_IGNORED, K.ZERO_UNSUPPORTED)
    path = "zero_optimization"
    stage, src = r.get(path, zero, "stage", choice((0, 1, 2, 3)), 0)
    out["stage"] = stage
    r.record("stage", stage, src, "zero_optimization.stage")
    for key, dep in (("offload_optimizer", "cpu_offload"), ("offload_param", "cpu_offload_param")):
        _offload(r, zero, key)
        if zero.get(dep) is not None and boolean(f"{path}.{dep}", zero[dep]):
            r.unsupported.append(f"{path}.{dep}")
    sizes = {k: v for k, v in (_elements(r, zero, (k,)) for k in ("reduce_bucket_size", "allgather_bucket_size"))
             if v is not None and k is not None}
    for key, value in sizes.items():
        if value < 1:
            raise ConfigError(f"{key}: {value!r} must be >= 1")
    if sizes:  # one bucket size in fz: the smaller respects both limits
        key = min(sizes, key=sizes.get)
        out["bucket_mb"] = sizes[key] * 4 / 2**20
        r.record("bucket_mb", out["bucket_mb"], "config", f"{key} * 4 / 2**20")
    _note_auto(r, zero, "bucket_mb", ("reduce_bucket_size", "allgather_bucket_size"))
    bucket_elems = out.get("bucket_mb", r.default("bucket_mb")) * 2**20 / 4

    mics, src = r.get(path, zero, "mics_shard_size", integer(-1, 2**31), -1)
    if mics == 0 or mics < -1:
        raise ConfigError(f"{path}.mics_shard_size: {mics!r} must be -1 (off) or a group size >= 1")
    if mics != -1:  # MiCS: shard within groups of this many ranks, replicate across them
        out["shard_group_size"] = mics
        r.record("shard_group_size", mics, src, f"{path}.mics_shard_size")

    key, persist = _elements(r, zero, ("stage3_param_persistence_threshold", "param_persistence_threshold"))
    if persist is not None:
        out["persist_threshold"] = persist
        r.record("persist_threshold", persist, "config", key)
    _note_auto(r, zero, "persist_threshold", ("stage3_param_persistence_threshold", "param_persistence_threshold"))

    key, prefetch = _elements(r, zero, ("stage3_prefetch_bucket_size", "prefetch_bucket_size"))
    if "prefetch" not in fields:
        if key is not None:
            r.ignored.append(key)
    elif prefetch is not None:
        out["prefetch"] = int(prefetch // bucket_elems)
        r.record("prefetch", out["prefetch"], "config", f"{key} // bucket elements")
    else:
        _note_auto(r, zero, "prefetch", ("stage3_prefetch_bucket_size", "prefetch_bucket_size"))
    min_live = 2 + out.get("prefetch", r.default("prefetch") if "prefetch" in fields else 0)

    key, live = _elements(r, zero, ("stage3_max_live_parameters", "max_live_parameters"))
    if live is not None:
        out["live_buckets"] = max(min_live, int(live // bucket_elems))
        r.record("live_buckets", out["live_buckets"], "config", f"{key} // bucket elements (>= {min_live})")
    elif r.default("live_buckets") < min_live:
        out["live_buckets"] = min_live
        r.record("live_buckets", min_live, "config", "2 + prefetch")
    return out


def _elements(r: Reader, zero: Dict[str, Any], names: Tuple[str, ...]) -> Tuple[Optional[str], Optional[int]]:
    """(key path, element count) under the first of `names` present; "auto" or null: (path, None)."""
    for name in names:
        if name in zero:
            value, _ = r.get("zero_optimization", zero, name, integer(0, 2**62), None, auto_value=None)
            return f"zero_optimization.{name}", value
    return None, None


def _note_auto(r: Reader, zero: Dict[str, Any], field: str, names: Tuple[str, ...]) -> None:
    """Record an "auto" tuning size as fz's default, so explain() shows where it went."""
    if field in r.entries:
        return
    for name in names:
        if zero.get(name) == AUTO:
            r.record(field, r.default(field), "default", f'zero_optimization.{name} ("auto")')
            return


def _precision(r: Reader, cfg: Dict[str, Any]) -> Tuple[str, Any]:
    enabled, sections = {}, {}
    for key, used, ignored, unsupported in (("fp16", K.FP16_USED, K.FP16_IGNORED, K.FP16_UNSUPPORTED),
                                            ("bf16", K.BF16_USED, K.BF16_IGNORED, K.BF16_UNSUPPORTED)):
        name = "bfloat16" if key == "bf16" and "bf16" not in cfg and "bfloat16" in cfg else key
        sections[key] = (name, section(name, {} if cfg.get(name) is None else cfg[name]))
        r.check_keys(name, sections[key][1], used, ignored, unsupported)
    for key, other in (("fp16", "bf16"), ("bf16", "fp16")):
        name, d = sections[key]
        if d.get("enabled") == AUTO and "precision" not in r.auto and sections[other][1].get("enabled") is True:
            enabled[key] = (False, "config", d)  # "auto" beside an explicit other: must be off
            continue
        value, src = r.get(name, d, "enabled", boolean, False, auto="precision")
        if src == "auto":
            value = r.auto["precision"] == key
        enabled[key] = (value, src, d)
    if enabled["fp16"][0] and enabled["bf16"][0]:
        raise ConfigError("fp16.enabled and bf16.enabled are both true: choose one")
    key = "fp16" if enabled["fp16"][0] else "bf16" if enabled["bf16"][0] else None
    precision, src = ("fp32", "default") if key is None else (key, enabled[key][1])
    if key is None and (enabled["fp16"][1] == "auto" or enabled["bf16"][1] == "auto"):
        src = "auto"
    r.record("precision", precision, src, f"{key}.enabled" if key else "fp16.enabled / bf16.enabled")
    d = enabled["fp16"][2]
    p = "fp16"
    args = dict(
        loss_scale=r.get(p, d, "loss_scale", number(0.0), 0.0)[0],
        initial_scale_power=r.get(p, d, "initial_scale_power", integer(0, 1000), 16)[0],
        loss_scale_window=r.get(p, d, "loss_scale_window", integer(1, 2**62), 1000)[0],
        hysteresis=r.get(p, d, "hysteresis", integer(1, 2**62), 2)[0],
        consecutive_hysteresis=r.get(p, d, "consecutive_hysteresis", boolean, False)[0],
        min_loss_scale=r.get(p, d, "min_loss_scale", number(0.0, lo_open=True), 1.0)[0],
    )
    if key != "fp16":  # checked, but only an enabled fp16 section scales the loss
        r.ignored.extend(f"fp16.{k}" for k in args if k in d)
        return precision, LossScale()
    scaling = LossScale(**args)
    r.record("loss_scaling", scaling, "config" if any(k in d for k in args) else "default", "fp16.*")
    return precision, scaling


def _activation_checkpointing(r: Reader, raw: Any) -> Optional[bool]:
    if raw is None:
        return None
    path = "activation_checkpointing"
    d = section(path, raw)
    r.check_keys(path, d, K.ACTIVATION_KEYS)
    on = False
    for key in K.ACTIVATION_KEYS:
        check = optional(integer(1, 2**62)) if key == "number_checkpoints" else boolean
        value = check(f"{path}.{key}", d.get(key, None if key == "number_checkpoints" else False))
        if key in d:
            (r.unsupported if key == "cpu_checkpointing" and value else r.ignored).append(f"{path}.{key}")
        on = on or (key in K.ACTIVATION_ENABLING and value not in (False, None))
    keys = [k for k in K.ACTIVATION_ENABLING if d.get(k) not in (None, False)]
    r.record("activation_checkpointing", on, "config", " / ".join(f"{path}.{k}" for k in keys) or path)
    return on


def _tensorboard(r: Reader, raw: Any) -> Optional[str]:
    if raw is None:
        return None
    path = "tensorboard"
    d = section(path, raw)
    r.check_keys(path, d, K.TENSORBOARD_KEYS)
    enabled = r.get(path, d, "enabled", boolean, False)[0]
    output = r.get(path, d, "output_path", optional(string), "")[0] or ""
    job = r.get(path, d, "job_name", string, "DeepSpeedJobName")[0]
    log_dir = (os.path.join(output, job) if output else job) if enabled else None
    r.record("log_dir", log_dir, "config", "tensorboard.output_path / job_name")
    return log_dir


def read_deepspeed(spec_cls: type, config: Union[dict, str, os.PathLike], **auto: Any):
    """A DeepSpeed config (dict, path, or JSON text) -> `spec_cls` (fz.Spec, which calls this:
    fz.config never imports fz.spec); see the module docstring."""
    fields = {f.name: f.default for f in dataclasses.fields(spec_cls)}
    cfg, origin = load(config)
    auto = _check_auto(auto)
    r = Reader({k: v for k, v in auto.items() if k != "world_size"}, fields)
    r.check_keys("", cfg, K.TOP_USED, K.TOP_IGNORED, K.TOP_UNSUPPORTED)
    if "bf16" in cfg and "bfloat16" in cfg:
        r.ignored.append("bfloat16 (bf16 wins, as in DeepSpeed)")
    world, source = _world_size(auto)
    r.record("world_size", world, source, "torch.distributed / world_size=")
    out: Dict[str, Any] = {}
    out["micro_batch"], out["grad_accum"] = _batch(r, cfg, world)
    out.update(_zero(r, cfg.get("zero_optimization"), fields))
    out["precision"], out["loss_scaling"] = _precision(r, cfg)

    clip, source = r.get("", cfg, "gradient_clipping", number(0.0), 0.0, auto="clip_grad_norm")
    out["clip_grad_norm"] = clip or None  # DeepSpeed: 0 turns clipping off
    r.record("clip_grad_norm", out["clip_grad_norm"], source, "gradient_clipping")
    for field, key, check, default in (
            ("reduce_dtype", "communication_data_type", optional(choice(K.COMM_DTYPES)), None),
            ("log_every", "steps_per_print", integer(1, 2**62), r.default("log_every")),
            ("seed", "seed", integer(-2**63, 2**64 - 1), r.default("seed"))):
        out[field], source = r.get("", cfg, key, check, default)
        r.record(field, out[field], source, key)
    ac = _activation_checkpointing(r, cfg.get("activation_checkpointing"))
    if ac is not None:
        out["activation_checkpointing"] = ac
    log_dir = _tensorboard(r, cfg.get("tensorboard"))
    if "tensorboard" in cfg:
        out["log_dir"] = log_dir

    opt = OptimizerConfig(r, cfg.get("optimizer"))
    schedule = read_scheduler(r, cfg.get("scheduler"), opt.lr if opt.kind else 1e-3,
                              has_betas=opt.kind not in ("sgd", "adafactor"))
    if opt.kind is not None:
        out["optimizer"], text = opt.build(schedule if schedule is not None else opt.lr)
        r.record("optimizer", text, "config", "optimizer")
    elif schedule is not None:
        out["optimizer"] = optim.adamw(lr=schedule)
        r.record("optimizer", Described(f"fz.optim.adamw(lr={schedule!r})"), "default", "scheduler (no optimizer)")
    else:
        out["optimizer"] = optim.adamw(lr=1e-3, weight_decay=0.01)
        r.record("optimizer", Described("fz.optim.adamw(lr=0.001, weight_decay=0.01)"), "default", "")
    unused = [k for k in r.auto if k not in r.used_auto]
    prov = Provenance(r.entries, r.keys, r.ignored, r.unsupported, unused, origin,
                      objects={"optimizer": out["optimizer"]})
    try:
        return spec_cls(**out, provenance=prov)
    except ConfigError as e:
        raise ConfigError(f"the DeepSpeed config gives an invalid Spec: {e}") from None
