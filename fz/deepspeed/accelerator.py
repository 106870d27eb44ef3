"""`deepspeed.accelerator.get_accelerator()` on fz: the device calls DeepSpeed scripts make
(`device_name()`, `set_device(local_rank)`, `is_bf16_supported()`, `synchronize()`, ...), on CUDA
where torch sees a GPU, else on the CPU, answered by torch as DeepSpeed's CUDA and CPU
accelerators answer them. What fz does not provide is absent (an AttributeError), never a no-op
that answers wrongly. `communication_backend_name()` is the backend fz joins: "nccl" on CUDA,
"gloo" on the CPU (DeepSpeed's CPU accelerator says "ccl", oneCCL, which fz does not use).
"""
from __future__ import annotations

from typing import Any

import torch


class Accelerator:
    """One device kind's calls: "cuda" or "cpu"."""

    def __init__(self, name: str):
        self._name = name

    def device_name(self, device_index: int | None = None) -> str:
        return self._name if device_index is None or self._name == "cpu" else f"{self._name}:{device_index}"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._name == "cuda" else 0

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._name == "cuda" else "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._name == "cuda" else 1

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._name == "cuda" else True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed) if self._name == "cuda" else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed) if self._name == "cuda" else torch.manual_seed(seed)

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._name == "cuda" else True

    def is_fp16_supported(self) -> bool:
        return self._name == "cuda"  # DeepSpeed's CPU accelerator: only with AMX-FP16 (None here, falsy too)

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float, torch.bfloat16] + ([torch.half] if self.is_fp16_supported() else [])

    def communication_backend_name(self) -> str:
        return "nccl" if self._name == "cuda" else "gloo"

    def memory_allocated(self, device_index: int | None = None) -> int:
        """CUDA's allocated bytes; on the CPU the process's resident bytes, as DeepSpeed's CPU accelerator."""
        if self._name == "cuda":
            return torch.cuda.memory_allocated(device_index)
        rss = _proc("/proc/self/status", "VmRSS")
        self._peak = max(getattr(self, "_peak", 0), rss)
        return rss

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """CUDA's peak; on the CPU the largest resident size seen by these calls since the last reset."""
        if self._name == "cuda":
            return torch.cuda.max_memory_allocated(device_index)
        self.memory_allocated()
        return self._peak

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._peak = _proc("/proc/self/status", "VmRSS")

    def total_memory(self, device_index: int | None = None) -> int:
        if self._name == "cuda":
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return _proc("/proc/meminfo", "MemTotal")

    def available_memory(self, device_index: int | None = None) -> int:
        if self._name == "cuda":
            return torch.cuda.mem_get_info(device_index)[0]
        return _proc("/proc/meminfo", "MemAvailable")

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._name == "cuda" else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._name == "cuda" else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def __repr__(self) -> str:
        return f"fz.deepspeed accelerator {self._name!r}"


def _proc(path: str, field: str) -> int:
    """A kB field of /proc/meminfo or /proc/self/status, in bytes (DeepSpeed reads them through psutil)."""
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{path} has no {field}")


_current: Any = None


def get_accelerator() -> Accelerator:
    """The accelerator of this process: CUDA where torch sees a GPU, else the CPU (chosen on first use)."""
    global _current
    if _current is None:
        _current = Accelerator("cuda" if torch.cuda.is_available() else "cpu")
    return _current


__all__ = ["Accelerator", "get_accelerator"]
