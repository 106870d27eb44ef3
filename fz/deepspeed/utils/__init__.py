"""`deepspeed.utils` on fz: the logger and `log_dist` DeepSpeed scripts log with, and
`zero_to_fp32`'s functions (fz/deepspeed/utils/zero_to_fp32.py), and `safe_get_full_fp32_param`
and its kin (fz/deepspeed/utils/tensor_fragment.py).

`log_dist(message, ranks)` logs "[Rank r] message" on the ranks listed (`[-1]`: every rank; none
listed: only where no process group is up), at `level`, through `logger` ("DeepSpeed", WARNING
by default), as DeepSpeed 0.19.8's does.
"""
from __future__ import annotations

import logging

import torch.distributed as dist

from fz.deepspeed.utils import zero_to_fp32
from fz.deepspeed.utils.tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
)

logger = logging.getLogger("DeepSpeed")


def _message(message: object, ranks: list[int] | None) -> str | None:
    """DeepSpeed's get_dist_msg: the message with its rank prefix, or None where it is not logged."""
    up = dist.is_available() and dist.is_initialized()
    me = dist.get_rank() if up else -1
    listed = ranks or []
    if up and not (listed and (listed[0] == -1 or me in set(listed))):
        return None
    return f"[Rank {me}] {message}"


def log_dist(message: object, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """`message` logged on the ranks listed ([-1]: all), prefixed with the rank."""
    line = _message(message, ranks)
    if line is not None:
        logger.log(level, line)


def print_dist(message: object, ranks: list[int] | None = None) -> None:
    """`message` printed on the ranks listed, whatever the log level (DeepSpeed's print_dist)."""
    line = _message(message, ranks)
    if line is not None:
        print(line, flush=True)  # noqa: T201 - DeepSpeed's print_dist prints, by definition


__all__ = ["log_dist", "logger", "print_dist", "safe_get_full_fp32_param", "safe_get_full_grad",
           "safe_get_full_optimizer_state", "safe_set_full_fp32_param", "zero_to_fp32"]
