"""A rank's random state as one tensor: the CPU generator's, then the compute device's (CUDA).

Dropout on a GPU draws from the CUDA generator, not the CPU one, so a state that kept only
the CPU generator would resume a GPU run with other dropout masks. `State.rng` therefore
holds the CPU state followed by the CUDA generator's (on CUDA), and every step forks both,
sets them from the state and returns both. A state made on the CPU (or a checkpoint
saved there) carries no CUDA part: on CUDA it is derived from the CPU part, so the same
state always gives the same masks.
"""
from __future__ import annotations

import contextlib
import math
import struct
import zlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor


def _cpu_bytes() -> int:
    return torch.get_rng_state().numel()


def well_formed(dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """Whether a saved state of this dtype and shape is one `capture` makes: bytes, the CPU
    generator's state, and maybe a CUDA generator's (a few bytes) after it."""
    n = _cpu_bytes()
    return dtype == torch.uint8 and len(shape) == 1 and n <= shape[0] <= n + 256


MT_WORDS = 624  # the Mersenne Twister's state words; torch's CPU state is its legacy struct, 5056 bytes


def problem(rng: Tensor) -> str | None:
    """Why a saved state (as `capture` makes it) is not one a generator can be in, or None. torch
    checks only part of it: a position past the state's words passes, and the generator then reads
    memory beyond them (its draws, dropout masks, come from whatever lies there); a bool byte
    other than 0 or 1 is undefined behaviour in its C++."""
    raw = rng[:_cpu_bytes()].contiguous().numpy().tobytes()
    if len(raw) != 5056:  # another torch's layout: only torch's own check applies
        return None
    _, left, seeded, position = struct.unpack_from("<qiiQ", raw, 0)
    normal_valid = struct.unpack_from("<i", raw, 24 + 8 * MT_WORDS + 24)[0]
    sample, sample_valid = struct.unpack_from("<fB", raw, 5048)
    reached = (left == 1 and position == 0) or (1 <= left <= MT_WORDS and left + position == MT_WORDS + 1)
    if seeded != 1 or not reached:
        return (f"its Mersenne Twister position (left {left}, next {position}, seeded {seeded}) is not one a "
                "generator reaches")
    if normal_valid not in (0, 1) or sample_valid not in (0, 1) or not math.isfinite(sample):
        return "its cached normal sample's flags or value are not ones a generator writes"
    return None


def capture(device: torch.device) -> Tensor:
    """The current generators' state for a computation on `device`."""
    cpu = torch.get_rng_state()
    if device.type != "cuda":
        return cpu
    return torch.cat([cpu, torch.cuda.get_rng_state(device)])


def restore(rng: Tensor, device: torch.device) -> None:
    """Set the generators from `rng` (as `capture` made it, or a CPU-only state)."""
    n = _cpu_bytes()
    torch.set_rng_state(rng[:n].contiguous())
    if device.type != "cuda":
        return
    if rng.numel() > n:
        torch.cuda.set_rng_state(rng[n:].contiguous(), device)
    else:  # no CUDA part (made on a CPU): one derived from the CPU part, the same every time
        with torch.cuda.device(device):
            torch.cuda.manual_seed(zlib.crc32(rng[:n].numpy().tobytes()))


@contextlib.contextmanager
def forked(rng: Tensor, device: torch.device) -> Iterator[Callable[[], Tensor]]:
    """Run with the generators set from `rng`, the caller's own restored afterwards; yields a
    function returning the generators' state at that point (the step's new `rng`)."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        restore(rng, device)
        yield lambda: capture(device)


def seeded(seed: int, device: torch.device) -> Tensor:
    """A fresh state from `seed`, for both generators."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return capture(device)
