"""Offload policies: where the optimizer state and the parameters live (device, host or disk).

A policy is a value (set on the Spec, applied by `fz.init`) and a function from state to
state: `fz.offload.nvme(path)(state)` writes the optimizer state to files and returns a
state whose leaves are DiskTensors; `fz.offload.none()(state)` brings every leaf back.
The step uses each leaf where it lives (fz/step/stream.py); nothing is moved behind
the user's back, and `fz.memory_report` shows the bytes per tier.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fz.errors import ConfigError
from fz.offload.move import apply_policy

TIERS = ("device", "host", "disk")


@dataclass(frozen=True)
class Offload:
    """Tiers of the optimizer state (fp32 master weights and moments) and of the parameters.

    DeepSpeed's `offload_optimizer` / `offload_param` (`device`: none/cpu/nvme; `nvme_path`,
    `pin_memory`, `buffer_count`, `buffer_size`) map onto these fields.
    """

    optimizer: str = "device"
    params: str = "device"
    path: str | None = None  # the disk tier's directory (nvme)
    pin_memory: bool = True  # host buffers pinned (CUDA only: pinned memory makes copies asynchronous)
    buffer_mb: float = 16.0  # one I/O buffer; a group of rows streamed at a time fits in it
    buffers: int = 4  # I/O buffers: resident memory for disk-tier state is buffers x buffer_mb
    prefetch: int = 2  # groups read ahead while one is updated
    io_threads: int = 2
    direct_io: bool = True  # O_DIRECT where the filesystem allows it (else buffered, with a warning)
    # bound on the pinned host memory of the transfer pool (gradients leaving the device: one fp32
    # buffer per bucket, reused step after step); past it, plain host memory (copies then block).
    # None: as much as the step's gradients need. memory_report's `pinned` shows what is held.
    max_pinned_mb: float | None = None
    # stage 3 with parameters and optimizer on disk: the update streams on in the background after
    # the step returns, and the next forward starts on each bucket once it is written (fz/step/pending.py)
    pipeline: bool = True

    per_rank_fields = ("path",)  # each rank may name a local disk of its own: not compared across ranks

    def __post_init__(self) -> None:
        for field in ("optimizer", "params"):
            if getattr(self, field) not in TIERS:
                raise ConfigError(f"fz.offload: {field}={getattr(self, field)!r} must be one of {', '.join(TIERS)}")
        if "disk" in (self.optimizer, self.params) and not self.path:
            raise ConfigError("fz.offload: the disk tier needs a path (fz.offload.nvme(path=...))")
        if self.params == "disk" and self.optimizer != "disk":
            raise ConfigError("fz.offload: params on disk need the optimizer state on disk too (the update streams "
                              "both from the same files); use fz.offload.nvme(path, params=True)")
        if not self.buffer_mb > 0:
            raise ConfigError(f"fz.offload: buffer_mb={self.buffer_mb!r} must be > 0")
        if not isinstance(self.buffers, int) or self.buffers < 2:
            raise ConfigError(f"fz.offload: buffers={self.buffers!r} must be an integer >= 2 (one updating, one "
                              "reading or writing)")
        if not isinstance(self.prefetch, int) or not 0 <= self.prefetch <= self.buffers - 1:
            raise ConfigError(f"fz.offload: prefetch={self.prefetch!r} must be an integer in 0..buffers-1 "
                              f"({self.buffers - 1})")
        if self.max_pinned_mb is not None and not self.max_pinned_mb >= 0:
            raise ConfigError(f"fz.offload: max_pinned_mb={self.max_pinned_mb!r} must be >= 0 (or None: no bound)")
        if not isinstance(self.io_threads, int) or self.io_threads < 1:
            raise ConfigError(f"fz.offload: io_threads={self.io_threads!r} must be an integer >= 1")

    @property
    def disk_path(self) -> str:
        """`path`, which the disk tier has (checked when the policy is made)."""
        if self.path is None:
            raise ConfigError("fz.offload: the disk tier needs a path (fz.offload.nvme(path=...))")
        return self.path

    @property
    def active(self) -> bool:
        return self.optimizer != "device" or self.params != "device"

    def check_stage(self, stage: int) -> None:
        if self.params != "device" and stage != 3:
            raise ConfigError(
                f"fz.offload: params={self.params!r} needs ZeRO stage 3 (below it every rank holds "
                f"whole parameters; a DeepSpeed config's offload_param there is ignored with a warning, as DeepSpeed "
                f"ignores it); this spec is stage {stage}"
            )
        if self.optimizer != "device" and stage == 0:
            raise ConfigError("fz.offload: offloading the optimizer needs ZeRO stage 1, 2 or 3 (as DeepSpeed's "
                              "offload_optimizer): at stage 0 every rank would stream the whole optimizer state")

    def __call__(self, state: Any) -> Any:  # fz.State (a layer above) -> fz.State
        """`state` with its leaves moved to this policy's tiers (a new state; the old one is unchanged)."""
        return apply_policy(self, state)

    def replace(self, **changes: Any) -> Offload:
        return dataclasses.replace(self, **changes)


def cpu(optimizer: bool = True, params: bool = False, pin_memory: bool = True,
        max_pinned_mb: float | None = None) -> Offload:
    """ZeRO-Offload: optimizer state (and at stage 3 the parameter shards) in host memory;
    the optimizer runs on the host, and gradients go there as they are reduced."""
    return Offload("host" if optimizer else "device", "host" if params else "device", pin_memory=pin_memory,
                   max_pinned_mb=max_pinned_mb)


def nvme(path: str, optimizer: bool = True, params: bool = False, *, buffer_mb: float = 16.0, buffers: int = 4,
         prefetch: int = 2, io_threads: int = 2, pin_memory: bool = True, direct_io: bool = True,
         max_pinned_mb: float | None = None, pipeline: bool = True) -> Offload:
    """ZeRO-Infinity: optimizer state (and at stage 3 the parameter shards) in files under `path`,
    streamed through `buffers` x `buffer_mb` of memory; gradients go to the host as they are reduced."""
    return Offload("disk" if optimizer else "device", "disk" if params else "device", path, pin_memory, buffer_mb,
                   buffers, prefetch, io_threads, direct_io, max_pinned_mb, pipeline)


def none() -> Offload:
    """Everything on the device (applied to a state, brings every leaf back)."""
    return Offload()
