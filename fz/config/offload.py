"""DeepSpeed's offload sections -> an `fz.offload` policy.

`zero_optimization.offload_optimizer` / `offload_param` (`device` none|cpu|nvme, `nvme_path`,
`pin_memory`, `buffer_count`, `buffer_size`; the old `cpu_offload*` booleans) and the `aio`
section (`thread_count` / `intra_op_parallelism` -> I/O threads; the libaio tuning keys have
no counterpart in fz's preadv/pwritev thread pool and are listed as having no effect).
`ratio` < 1 (offload part of the optimizer) is refused: fz moves a whole tier.
"""
from __future__ import annotations

from typing import Any

from fz.config import keys as K
from fz.config.reader import Reader
from fz.config.values import boolean, choice, integer, number, string
from fz.errors import ConfigError

PATH = "zero_optimization"
TIER = {"none": "device", "cpu": "host", "nvme": "disk"}
AIO_THREADS = ("thread_count", "intra_op_parallelism")
AIO_NO_EFFECT = {"block_size", "queue_depth", "single_submit", "overlap_events", "use_gds"}
MAX_IN_CPU = 1e9  # DeepSpeed's default: the parameter elements its NVMe offload may cache in host memory
NO_EFFECT = {"fast_init", "pipeline_read", "pipeline_write", "pipeline", "super_offload", "cpuadam_cores_perc",
             "max_in_cpu"}


def _section(r: Reader, zero: dict[str, Any], key: str, old: str) -> dict[str, Any]:
    """One offload section read: {'tier', 'path', 'pin', 'buffers', 'buffer_elements'}."""
    path = f"{PATH}.{key}"
    out: dict[str, Any] = {"tier": "device"}
    if zero.get(old) is not None:
        on = boolean(f"{PATH}.{old}", zero[old])
        r.mark(f"{PATH}.{old}", "mapped" if on else "ignored", "device 'cpu'" if on else "off")
        out["tier"] = "host" if on else "device"
    v = zero.get(key)
    if isinstance(v, bool) or v is None:  # older configs: "offload_optimizer": true/false
        if key in zero:
            r.mark(path, "mapped" if v else "ignored", "device 'cpu'" if v else "off")
        if v:
            out["tier"] = "host"
        return out
    d = r.section(PATH, zero, key)
    r.check_keys(path, d, K.OFFLOAD_KEYS)
    device, _ = r.get(path, d, "device", choice(K.OFFLOAD_DEVICES), "none")
    out["tier"] = TIER[device]
    for k in NO_EFFECT & set(d):
        r.mark(f"{path}.{k}", "ignored", "no effect in fz (DeepSpeed's own I/O and CPU-Adam tuning)")
    if device == "nvme" and key == "offload_param" and d.get("max_in_cpu") not in (None, MAX_IN_CPU):
        r.advice.append(f"{path}.max_in_cpu={d['max_in_cpu']!r} has no effect: fz keeps no parameters in host "
                        "memory between uses beyond its offload buffers (buffer_count x buffer_size); "
                        "fz.estimate gives the host bytes")
    if device == "none":
        for k in set(d) - {"device"}:
            r.mark(f"{path}.{k}", "ignored", "device 'none'")
        return out
    ratio, _ = r.get(path, d, "ratio", number(0.0, 1.0), 1.0)
    if ratio != 1.0:
        raise ConfigError(f"{path}.ratio={ratio!r}: fz offloads the whole optimizer state, not a fraction of it "
                          "(set 1.0, or drop the key)")
    out["pin"], _ = r.get(path, d, "pin_memory", boolean, None)
    out["buffers"], _ = r.get(path, d, "buffer_count", integer(2, 1 << 16), None)
    out["buffer_elements"], _ = r.get(path, d, "buffer_size", integer(1, 1 << 40), None)
    if device == "nvme":
        out["path"], _ = r.get(path, d, "nvme_path", string)
    elif "nvme_path" in d:
        r.mark(f"{path}.nvme_path", "ignored", f"device {device!r}")
    return out


def read_offload(r: Reader, cfg: dict[str, Any], zero: dict[str, Any], stage: int = 3) -> Any | None:
    """The policy both sections describe (None when nothing is offloaded), recorded as `offload`.
    Below ZeRO-3 offload_param has no effect (each rank holds whole parameters): DeepSpeed ignores
    it there, and fz says so."""
    from fz.offload.policy import Offload
    opt = _section(r, zero, "offload_optimizer", "cpu_offload")
    par = _section(r, zero, "offload_param", "cpu_offload_param")
    if stage < 3 and par["tier"] != "device":
        for key in ("offload_param.device", "offload_param.nvme_path", "offload_param", "cpu_offload_param"):
            if f"{PATH}.{key}" in r.outcomes:  # the key as the config spells it
                r.mark(f"{PATH}.{key}", "ignored", f"no effect at stage {stage}, as in DeepSpeed (parameters are "
                                                   "offloaded at stage 3 only)")
        r.advice.append(f"{PATH}.offload_param has no effect at ZeRO stage {stage}: parameters are offloaded at "
                        "stage 3 only (DeepSpeed ignores it there too)")
        par = {"tier": "device", "path": None}  # none of its settings either (pin_memory, buffers)
    aio = r.section("", cfg, "aio")
    r.check_keys("aio", aio, AIO_THREADS, AIO_NO_EFFECT)
    for k in AIO_NO_EFFECT & set(aio):
        r.mark(f"aio.{k}", "ignored", "no effect: fz's I/O is a preadv/pwritev thread pool (O_DIRECT), not libaio")
    threads = None
    for k in AIO_THREADS:
        if k in aio:
            threads, _ = r.get("aio", aio, k, integer(1, 1024))
    if opt["tier"] == "device" and par["tier"] == "device":
        for k in AIO_THREADS:
            if k in aio:
                r.mark(f"aio.{k}", "ignored", "nothing is offloaded")
        return None
    paths = {s["path"] for s in (opt, par) if s.get("path")}
    if len(paths) > 1:
        raise ConfigError(f"{PATH}: offload_optimizer.nvme_path and offload_param.nvme_path differ ({sorted(paths)}); "
                          "fz keeps one directory for the disk tier")
    pins = [s["pin"] for s in (opt, par) if s.get("pin") is not None]
    buffers = [s["buffers"] for s in (opt, par) if s.get("buffers")]
    elements = [s["buffer_elements"] for s in (opt, par) if s.get("buffer_elements")]
    for key, values, taken in (("pin_memory", pins, "false"), ("buffer_count", buffers, "the larger"),
                               ("buffer_size", elements, "the larger")):
        if len(set(values)) > 1:
            r.advice.append(f"{PATH}.offload_optimizer.{key} and offload_param.{key} differ ({values[0]} and "
                            f"{values[1]}): fz has one {key} for both tiers and takes {taken}")
    kw: dict[str, Any] = {}
    if buffers:
        kw["buffers"] = max(buffers)
        kw["prefetch"] = min(2, kw["buffers"] - 1)
    if elements:  # DeepSpeed counts fp32 elements
        kw["buffer_mb"] = max(elements) * 4 / 2**20
    if threads is not None:
        kw["io_threads"] = threads
    policy = Offload(opt["tier"], par["tier"], next(iter(paths), None), all(pins) if pins else True, **kw)
    r.record("offload", policy, "config", f"{PATH}.offload_optimizer / offload_param")
    return policy
