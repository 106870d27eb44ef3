"""The budgets a plan must fit: device memory, host memory, free disk.

Each budget given is the one planned for, whatever machine runs the planner: plans are made on
login nodes and laptops for the GPUs a job will get (as with DeepSpeed's estimator). A budget
not given is this machine's. Only with no device budget and no GPU is the device the host: one
memory then holds both tiers of every local rank, so a plan checks their sum against it.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import torch

GB = 2**30


@dataclass(frozen=True)
class Budgets:
    """Bytes a plan may use (before the safety margin)."""

    device: int | None  # per device; None: no device budget given and no GPU here (device = host)
    host: int  # per host (node), shared by its ranks
    disk: int  # free bytes where the disk tier would live
    notes: tuple[str, ...] = ()  # a given budget beyond this machine's: which one is planned for, and why

    @property
    def device_is_host(self) -> bool:
        return self.device is None


def host_memory() -> int:
    """MemTotal from /proc/meminfo (the machine's RAM), else os.sysconf's pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def free_disk(path: str) -> int:
    """Free bytes of the filesystem `path` is (or would be, once created) on."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def gpu_memory() -> int | None:
    """Bytes of this machine's first GPU, None without CUDA."""
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def plan_budgets(nvme_path: str, device: float | None = None, host: float | None = None,
                 disk: float | None = None) -> Budgets:
    """The given budgets (bytes), this machine's for those not given. A given budget always wins,
    larger or smaller than what is here: the plan is for the machine the job runs on; where it
    exceeds this machine's, a note says so (the plan may not fit here)."""
    gpu, ram, room = gpu_memory(), host_memory(), free_disk(nvme_path)
    here = {"device": gpu, "host": ram, "disk": room}
    given = {"device": device, "host": host, "disk": disk}
    notes = []
    for kind, want in given.items():
        have = here[kind]
        if want is not None and have is not None and want > have:
            what = {"device": "GPU", "host": "RAM", "disk": f"free disk under {nvme_path}"}[kind]
            notes.append(f"{kind} budget {want / GB:.2f} GB given, this machine has {have / GB:.2f} GB ({what}): "
                         "the given one wins (a plan is for the machine the job runs on), so it may not fit here")
    return Budgets(gpu if device is None else int(device), ram if host is None else int(host),
                   room if disk is None else int(disk), tuple(notes))


def local_devices() -> int:
    """Ranks a node runs by default: its GPUs, else 1."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 1
