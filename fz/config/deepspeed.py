"""`Spec.from_deepspeed`: a DeepSpeed JSON config (dict or path) -> an fz.Spec.

"auto" values (and absent keys) are filled from keyword arguments (fz.config.keywords,
the values a Hugging Face Trainer passes); the world size comes from `world_size=` or
torch.distributed (else 1). Other absent keys take fz's defaults (DeepSpeed's own for the
optimizer's parameters). Top-level keys DeepSpeed does not know either are accepted and
listed (`_comment`-style keys are comments), except near-misses of known keys with a stated
value, which are typos (one set to "auto" is warned); `strict=True` refuses them and
unsupported features. A key repeated in one object is refused (DeepSpeed refuses it; json
would keep the last). Everything read is recorded in
`spec.provenance`; `spec.explain()` prints it.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import stat
import sys
from typing import Any

from fz.config import keys as K
from fz.config.explain import Provenance
from fz.config.keywords import AUTO_NAMES, COUNT, check_keywords
from fz.config.optimizer import OptimizerConfig, read_scheduler
from fz.config.reader import Reader, key_order
from fz.config.values import AUTO, MISSING, boolean, choice, integer, number, optional, section, string
from fz.config.warn import report
from fz.config.zero import read_zero
from fz.errors import ConfigError
from fz.precision import MAX_LOSS_SCALE, MAX_SCALE_POWER, LossScale

__all__ = ["AUTO_NAMES", "read_deepspeed"]
NEAR_MISS = 0.8  # difflib ratio above which an unknown top-level key is a typo of a known one
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
MAX_CONFIG = 16 << 20  # bytes: a DeepSpeed config is a few KiB


def _read(path: str | os.PathLike) -> str:
    """A config file's text: a regular file (a FIFO would block the read forever, a device never
    ends), opened without blocking and checked before a byte is read, of at most MAX_CONFIG bytes."""
    name = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ConfigError(f"cannot read DeepSpeed config {name!r}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
                    else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device")
            raise ConfigError(f"DeepSpeed config {name!r} is not a regular file ({kind}): not read")
        raw = f.read(MAX_CONFIG + 1)
    if len(raw) > MAX_CONFIG:
        raise ConfigError(f"DeepSpeed config {name!r} is over {MAX_CONFIG >> 20} MiB: not a DeepSpeed config")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"DeepSpeed config {name!r} is not UTF-8 text ({e})") from None


class _Pairs(list):
    """A JSON object's (key, value) pairs in file order, before repeated keys are looked for."""


def _distinct(value: Any, path: str, origin: str) -> Any:
    """`value` with its objects as dicts; a key repeated in one object is refused, named by its path
    (json.loads keeps the last silently, so `"stage": 3, "stage": 0` read as stage 0; DeepSpeed refuses it)."""
    if isinstance(value, _Pairs):
        out: dict[str, Any] = {}
        for key, v in value:
            where = f"{path}.{key}" if path else key
            if key in out:
                raise ConfigError(f"DeepSpeed config {origin}: the key {where} appears twice (DeepSpeed refuses a "
                                  "repeated key, JSON would keep the last): keep one")
            out[key] = _distinct(v, where, origin)
        return out
    if isinstance(value, list):
        return [_distinct(v, f"{path}[{i}]", origin) for i, v in enumerate(value)]
    return value


def load(config: dict | str | os.PathLike) -> tuple[dict[str, Any], str]:
    """The config as a dict, and where it came from (for explain)."""
    if isinstance(config, dict):
        return section("config", config), "a dict"
    if isinstance(config, str) and config.lstrip().startswith("{"):
        text, origin = config, "a JSON string"
    elif isinstance(config, (str, os.PathLike)):
        try:
            text = _read(config)
        except OSError as e:
            raise ConfigError(f"cannot read DeepSpeed config {os.fspath(config)!r}: {e.strerror or e}") from None
        origin = repr(os.fspath(config))
    else:
        raise ConfigError(f"Spec.from_deepspeed needs a dict or a path to a JSON file, got {type(config).__name__}")
    try:
        try:
            pairs = json.loads(text, object_pairs_hook=_Pairs)
        except ValueError as e:
            raise ConfigError(f"DeepSpeed config {origin} is not valid JSON: {e}") from None
        data = _distinct(pairs, "", origin)
    except RecursionError:
        raise ConfigError(f"DeepSpeed config {origin} nests deeper than Python's recursion limit "
                          f"({sys.getrecursionlimit()} levels): not a DeepSpeed config") from None
    return section("config", data), origin


def _world_size(auto: dict[str, Any]) -> tuple[int, str]:
    from fz.sharding.mesh import user_world_size
    live = user_world_size()
    if "world_size" in auto:
        if live is not None and live != auto["world_size"]:
            raise ConfigError(f"world_size={auto['world_size']} but torch.distributed runs {live} processes")
        return auto["world_size"], "auto"
    return (live, "auto") if live is not None else (1, "default")


def _batch(r: Reader, cfg: dict[str, Any], world: int) -> tuple[int | None, int]:
    """(micro_batch, grad_accum) from any two of the three sizes: train = micro * accum * world.

    micro_batch= / grad_accum= fill their key when it is "auto" or absent; an explicit value
    must agree with them."""
    fill = {"train_batch_size": None, "train_micro_batch_size_per_gpu": "micro_batch",
            "gradient_accumulation_steps": "grad_accum"}
    known: dict[str, int] = {}
    source: dict[str, str] = {}
    how: dict[str, str] = {}  # derived sizes: the formula they came from
    pending = []
    for key in BATCH_KEYS:
        v = cfg.get(key)
        if isinstance(v, str) and v == AUTO or v is None:
            if key in cfg and v is None:
                r.mark(key, "ignored", "null")
            kw = r.keyword(fill[key])
            if kw is not MISSING:
                known[key], source[key] = kw, "auto"
                if key in cfg and v is not None:
                    r.mark(key, "auto", f"{fill[key]}={kw!r}")
            elif v is not None:
                pending.append(key)
        else:
            known[key], source[key] = COUNT(key, v), "config"
            r.agree(key, known[key], fill[key])
            r.mark(key, "mapped")
    for key in pending:
        r.mark(key, "auto", "train = micro x accum x world")
    train, micro, accum = (known.get(k) for k in BATCH_KEYS)

    def show(key: str) -> str:  # name a keyword's value as the keyword
        return f"{key}={known[key]}" + (f" ({fill[key]}=)" if source.get(key) == "auto" and fill[key] else "")

    if len(known) == 3:
        train, micro, accum = (known[k] for k in BATCH_KEYS)
        if train != micro * accum * world:
            raise ConfigError(f"{show('train_batch_size')} != {show('train_micro_batch_size_per_gpu')} * "
                              f"{show('gradient_accumulation_steps')} * world_size={world} "
                              f"(= {micro * accum * world})")
    elif len(known) == 2:
        derived = "auto" if pending or "auto" in source.values() else "config"
        if train is None:
            micro, accum = known[BATCH_KEYS[1]], known[BATCH_KEYS[2]]
            train = micro * accum * world
            known["train_batch_size"], source["train_batch_size"] = train, derived
            how["train_batch_size"] = f"{BATCH_KEYS[1]} * {BATCH_KEYS[2]} * world_size"
        else:
            given_key, other_key = BATCH_KEYS[1:] if accum is None else BATCH_KEYS[:0:-1]
            given = known[given_key]
            if train % (given * world):
                raise ConfigError(f"train_batch_size={train}, {show(given_key)} and world_size={world} give "
                                  f"{other_key}={train / (given * world):g}, not a positive integer "
                                  "(train_batch_size = micro batch * accumulation steps * world size)")
            known[other_key], source[other_key] = train // (given * world), derived
            how[other_key] = f"train_batch_size / ({given_key} * world_size)"
        pending = []
    if pending:
        key = pending[0]
        hint = f"pass {fill[key]}=... or " if fill[key] else ""
        raise ConfigError(f'{key}: "auto" is left without a value ({hint}give two of {", ".join(BATCH_KEYS)})')
    if len(known) == 1 and train is not None:  # DeepSpeed: accumulation 1, micro = train / world
        if train % world:
            raise ConfigError(f"train_batch_size={train} is not divisible by world_size={world} "
                              "(with gradient_accumulation_steps=1 and train_micro_batch_size_per_gpu unset)")
        known.update(gradient_accumulation_steps=1, train_micro_batch_size_per_gpu=train // world)
        source.update(gradient_accumulation_steps="default", train_micro_batch_size_per_gpu=source["train_batch_size"])
        how["train_micro_batch_size_per_gpu"] = "train_batch_size / world_size"
    elif len(known) == 1 and micro is not None:
        known.update(gradient_accumulation_steps=1, train_batch_size=micro * world)
        source.update(gradient_accumulation_steps="default", train_batch_size=source["train_micro_batch_size_per_gpu"])
        how["train_batch_size"] = "train_micro_batch_size_per_gpu * world_size"
    micro, accum = known.get("train_micro_batch_size_per_gpu"), known.get("gradient_accumulation_steps", 1)
    r.record("micro_batch", micro, source.get("train_micro_batch_size_per_gpu", "default"),
             how.get("train_micro_batch_size_per_gpu", "train_micro_batch_size_per_gpu"))
    r.record("grad_accum", accum, source.get("gradient_accumulation_steps", "default"),
             how.get("gradient_accumulation_steps", "gradient_accumulation_steps"))
    if "train_batch_size" in known:
        r.record("train_batch_size", known["train_batch_size"], source["train_batch_size"],
                 how.get("train_batch_size", "train_batch_size"))
    return micro, accum


def _precision(r: Reader, cfg: dict[str, Any], stage: int = 0) -> tuple[str, Any]:
    """precision= decides, adding a missing fp16/bf16 section as Accelerate does; an explicit
    `enabled` that disagrees with it is an error. Without it, "auto" beside an explicit true
    in the other section is false."""
    names = {"fp16": "fp16", "bf16": "bfloat16" if "bf16" not in cfg and "bfloat16" in cfg else "bf16"}
    if "bf16" in cfg and "bfloat16" in cfg:
        r.ignore_all("bfloat16", cfg["bfloat16"], "bf16 wins, as in DeepSpeed")
    sections = {key: r.section("", cfg, name) for key, name in names.items()}
    kw = r.keyword("precision")
    enabled: dict[str, tuple[bool, str, dict[str, Any]]] = {}
    for key, other in (("fp16", "bf16"), ("bf16", "fp16")):
        name, d = names[key], sections[key]
        path, v = f"{name}.enabled", d.get("enabled")
        if kw is not MISSING:
            if isinstance(v, str) and v == AUTO:
                r.mark(path, "auto", f"precision={kw!r}")
            elif v is not None:
                if boolean(path, v) != (kw == key):
                    raise ConfigError(f"{path}: the config says {str(v).lower()} but the keyword precision={kw!r}; "
                                      f'they contradict (make them agree, or set it to "auto")')
                r.mark(path, "mapped")
            elif "enabled" in d:
                r.mark(path, "ignored", "null")
            explicit = isinstance(v, bool)
            enabled[key] = (kw == key, "config" if explicit else "auto", d)
        elif v == AUTO and sections[other].get("enabled") is True:
            r.mark(path, "auto", f"false: {names[other]}.enabled is true")
            enabled[key] = (False, "config", d)
        else:
            enabled[key] = r.get(name, d, "enabled", boolean, False, auto="precision") + (d,)
    if enabled["fp16"][0] and enabled["bf16"][0]:
        raise ConfigError("fp16.enabled and bf16.enabled are both true: choose one")
    on = "fp16" if enabled["fp16"][0] else "bf16" if enabled["bf16"][0] else None
    precision, src = ("fp32", "default") if on is None else (on, enabled[on][1])
    if on is None and (enabled["fp16"][1] == "auto" or enabled["bf16"][1] == "auto"):
        src = "auto"
    where = f"{names[on]}.enabled" if on else "fp16.enabled / bf16.enabled"
    if on is not None and names[on] not in cfg:
        where = f"precision= (adds the {on} section, as Accelerate)"
    r.record("precision", precision, src, where)
    for k, table in (("fp16", (K.FP16_USED, K.FP16_IGNORED, K.FP16_UNSUPPORTED)),
                     ("bf16", (K.BF16_USED, K.BF16_IGNORED, K.BF16_UNSUPPORTED))):
        used, ignored, unsupported = table  # an unsupported option of a section that is off does nothing
        r.check_keys(names[k], sections[k], used, ignored,
                     unsupported if k == on else {u: (lambda v: False) for u in unsupported})
    d = enabled["fp16"][2]
    p = "fp16"
    args = dict(
        loss_scale=r.get(p, d, "loss_scale", number(0.0, MAX_LOSS_SCALE), 0.0)[0],
        initial_scale_power=r.get(p, d, "initial_scale_power", integer(0, MAX_SCALE_POWER), 16)[0],
        loss_scale_window=r.get(p, d, "loss_scale_window", integer(1, 2**62), 1000)[0],
        hysteresis=r.get(p, d, "hysteresis", integer(1, 2**62), 2)[0],
        consecutive_hysteresis=r.get(p, d, "consecutive_hysteresis", boolean, False)[0],
        min_loss_scale=r.get(p, d, "min_loss_scale", number(0.0, lo_open=True), 1.0)[0],
    )
    if on != "fp16":  # checked, but only an enabled fp16 section scales the loss
        for k in args:
            if k in d:
                r.mark(f"fp16.{k}", "ignored", "fp16 is off")
        return precision, LossScale()
    if stage == 0 and "hysteresis" in d:  # DeepSpeed's ZeRO-0 fp16 optimizer (FP16_Optimizer) has none
        r.mark("fp16.hysteresis", "ignored", "DeepSpeed's ZeRO-0 fp16 optimizer halves at every overflow")
    scaling = LossScale(**{**args, "hysteresis": 1 if stage == 0 else args["hysteresis"]}, raise_at_min=stage > 0)
    r.record("loss_scaling", scaling, "config" if any(k in d for k in args) else "default", "fp16.*")
    return precision, scaling


def _activation_checkpointing(r: Reader, cfg: dict[str, Any]) -> bool | None:
    """True when a key that configures checkpointing is set (the model then uses it)."""
    path = "activation_checkpointing"
    if cfg.get(path) is None:
        r.section("", cfg, path)
        return None
    d = r.section("", cfg, path)
    r.check_keys(path, d, K.ACTIVATION_KEYS)
    on = False
    for key in K.ACTIVATION_KEYS:
        check = optional(integer(1, 2**62)) if key == "number_checkpoints" else boolean
        value = d.get(key, None if key == "number_checkpoints" else False)
        value = None if key == "number_checkpoints" and value is False else check(f"{path}.{key}", value)
        enabling = key in K.ACTIVATION_ENABLING and value not in (False, None)
        on = on or enabling
        if key not in d:
            continue
        if key == "cpu_checkpointing" and value:
            r.mark(f"{path}.{key}", "unsupported", "fz keeps checkpoints on the device")
        else:
            r.mark(f"{path}.{key}", "mapped" if enabling else "ignored", "activation_checkpointing=True" if enabling
                   else "null" if value is None else "off" if key in K.ACTIVATION_ENABLING else "")
    keys = [k for k in K.ACTIVATION_ENABLING if d.get(k) not in (None, False)]
    r.record("activation_checkpointing", on, "config", " / ".join(f"{path}.{k}" for k in keys) or path)
    return on


def _monitor(r: Reader, cfg: dict[str, Any], path: str, field: str) -> str | None:
    """`tensorboard` / `csv_monitor`: output_path/job_name when enabled (fz.Monitor's log_dir / csv_dir)."""
    d = r.section("", cfg, path)
    if cfg.get(path) is None:
        r.record(field, None, "default")
        return None
    r.check_keys(path, d, K.TENSORBOARD_KEYS)
    enabled = r.get(path, d, "enabled", boolean, False)[0]
    output = r.get(path, d, "output_path", optional(string), "")[0] or ""
    job = r.get(path, d, "job_name", string, "DeepSpeedJobName")[0]
    out = (os.path.join(output, job) if output else job) if enabled else None
    r.record(field, out, "config", f"{path}.output_path / job_name")
    return out


def _data_types(r: Reader, cfg: dict[str, Any], accum: str) -> None:
    """data_types.grad_accum_dtype: fz keeps a gradient between micro-batches in `accum` (the compute
    dtype, DeepSpeed's default; fp32 on the host with the optimizer offloaded); another is warned."""
    d = r.section("", cfg, "data_types")
    r.check_keys("data_types", d, K.DATA_TYPES)
    dtype = r.get("data_types", d, "grad_accum_dtype", optional(choice(K.COMM_DTYPES)), None)[0]
    if dtype is None:
        return
    r.mark("data_types.grad_accum_dtype", "mapped" if dtype == accum else "unsupported",
           f"fz accumulates gradients between micro-batches in {accum}" + ("" if dtype == accum else f", not {dtype}"))


def _top_level(r: Reader, cfg: dict[str, Any], strict: bool) -> None:
    """Known keys are checked; DeepSpeed accepts unknown top-level keys, and so does fz (listed,
    warned) unless strict or a near-miss of a known key (a typo); `_`-prefixed ones are comments.
    A near-miss set to "auto" is warned, not refused: "auto" states no value, so the key cannot
    change training (FastChat's `"micro_batch_size_per_gpu": "auto"`; DeepSpeed ignores it)."""
    known = K.TOP_USED | K.TOP_IGNORED | set(K.TOP_UNSUPPORTED)
    for k in cfg:
        if k in known:
            continue
        close = difflib.get_close_matches(k, sorted(known), n=1, cutoff=NEAR_MISS)
        if k.startswith("_"):
            r.mark(k, "ignored", "a comment")
        elif close and not strict and isinstance(cfg[k], str) and cfg[k] == AUTO:
            r.mark(k, "ignored", f'"auto" on a key DeepSpeed does not know (did you mean {close[0]!r}?)')
            r.advice.append(f'{k}: unknown DeepSpeed key (did you mean {close[0]!r}?) set to "auto": ignored, as '
                            "DeepSpeed and the Hugging Face Trainer ignore it; \"auto\" states no value, so it "
                            "changes nothing (an unknown key with a stated value is an error)")
        elif close or strict:
            hint = f" (did you mean {close[0]!r}?)" if close else " (strict=True)"
            raise ConfigError(f"{k}: unknown DeepSpeed key{hint}")
        else:
            r.mark(k, "ignored", "not a DeepSpeed key")
            r.unknown.append(k)
    r.check_keys("", {k: v for k, v in cfg.items() if k in known}, K.TOP_USED, K.TOP_IGNORED, K.TOP_UNSUPPORTED)


def read_deepspeed(spec_cls: type, config: dict | str | os.PathLike, strict: bool = False, **auto: Any) -> Any:
    """A DeepSpeed config (dict, path, or JSON text) -> `spec_cls` (fz.Spec, which calls this:
    fz.config never imports fz.spec); see the module docstring."""
    fields = {f.name: f.default for f in dataclasses.fields(spec_cls)}
    cfg, origin = load(config)
    auto = check_keywords(auto)
    r = Reader({k: v for k, v in auto.items() if k != "world_size"}, fields)
    _top_level(r, cfg, boolean("strict", strict))
    world, source = _world_size(auto)
    r.record("world_size", world, source, "torch.distributed / world_size=")
    out: dict[str, Any] = {}
    out["micro_batch"], out["grad_accum"] = _batch(r, cfg, world)
    out.update(read_zero(r, cfg, fields))
    out["precision"], out["loss_scaling"] = _precision(r, cfg, int(out.get("stage", 0)))
    offload = out.get("offload")
    _data_types(r, cfg, "fp32" if offload is not None and offload.optimizer != "device" else out["precision"])

    # DeepSpeed's default is 1.0 (runtime/constants.py: GRADIENT_CLIPPING_DEFAULT): clipping is on unless set to 0
    clip, source = r.get("", cfg, "gradient_clipping", number(0.0), 1.0, auto="clip_grad_norm")
    out["clip_grad_norm"] = clip or None
    r.record("clip_grad_norm", out["clip_grad_norm"], source, "gradient_clipping")
    for field, key, check, default in (
            ("reduce_dtype", "communication_data_type", optional(choice(K.COMM_DTYPES)), None),
            ("seed", "seed", integer(-2**63, 2**64 - 1), r.default("seed"))):
        out[field], source = r.get("", cfg, key, check, default)
        r.record(field, out[field], source, key)
    ac = _activation_checkpointing(r, cfg)
    if ac is not None:
        out["activation_checkpointing"] = ac
    # monitoring is fz.Monitor's, not the Spec's: recorded as monitor.* for Monitor.from_spec
    every, source = r.get("", cfg, "steps_per_print", integer(1, 2**62), K.STEPS_PER_PRINT,
                          auto_value=K.STEPS_PER_PRINT)
    r.record("monitor.log_every", every, source, "steps_per_print")
    for key, field in (("tensorboard", "monitor.log_dir"), ("csv_monitor", "monitor.csv_dir")):
        _monitor(r, cfg, key, field)

    opt = OptimizerConfig(r, cfg)
    schedule = read_scheduler(r, cfg, opt.lr, has_betas=opt.kind not in ("sgd", "adafactor"))
    out["optimizer"], text = opt.build(schedule if schedule is not None else opt.lr)
    r.record("optimizer", text, opt.source, "optimizer" if opt.from_section else "(no optimizer section)")
    r.read_elsewhere(cfg, K.READ_ELSEWHERE)
    prov = Provenance(r.entries, r.keys, r.outcomes, [k for k in r.auto if k not in r.used_auto], origin,
                      objects={"optimizer": out["optimizer"], "lr": schedule if schedule is not None else opt.lr},
                      order=key_order(cfg))
    try:
        spec = spec_cls(**out, provenance=prov)
    except ConfigError as e:
        raise ConfigError(f"the DeepSpeed config gives an invalid Spec: {e}") from None
    report(prov.outcomes, r.unknown, r.advice, origin, strict)
    return spec
