"""What benchmarks/gpu_offload.py and gpu_offload_deepspeed.py share: the model's arguments (so both
run the same model and batch) and the host-memory readings (peak and current RSS). Imports no torch."""
from __future__ import annotations

import argparse
import resource


def add_model_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The GPT and batch both benchmarks train: defaults are a T0_3B-sized model (2.8B parameters)."""
    p.add_argument("--dim", type=int, default=2560)
    p.add_argument("--layers", type=int, default=34)
    p.add_argument("--heads", type=int, default=20)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro", type=int, default=4, help="sequences per step (one micro-batch)")
    p.add_argument("--steps", type=int, default=4, help="steps, the first one a warm-up")
    p.add_argument("--device-gb", type=float, default=24.0, help="cap on the device's memory (0: none)")
    p.add_argument("--same-batch", action="store_true", help="every step on the first batch (the loss then "
                   "measures fitting alone, not the batches' own differences)")
    return p


def hwm() -> int:
    """Peak resident bytes since the last reset (VmHWM; ru_maxrss where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss() -> int | None:
    """Resident bytes now (None where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def reset_hwm() -> bool:
    """Lower the peak to the current RSS (Linux), so a later hwm() is the steps' own; False if it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
