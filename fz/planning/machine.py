"""This machine's budgets, the defaults of `fz plan`: device memory, host memory, free disk.

On a machine without CUDA the device is the host: one memory holds both tiers of every
local rank, so a plan checks their sum against it.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Budgets:
    device: int  # bytes per device (on a CPU-only machine: the host's, shared by every local rank)
    host: int  # bytes per host
    disk: int  # free bytes where the disk tier would live
    device_is_host: bool  # CPU-only: device and host are one memory


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


def this_machine(nvme_path: str) -> Budgets:
    host = host_memory()
    if torch.cuda.is_available():
        return Budgets(torch.cuda.get_device_properties(0).total_memory, host, free_disk(nvme_path), False)
    return Budgets(host, host, free_disk(nvme_path), True)


def local_devices() -> int:
    """Ranks a node runs by default: its GPUs, else 1."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 1
