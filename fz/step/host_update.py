"""The host tier's update: the optimizer runs where the offloaded state lives, in host memory.

The gradients are already there (fz/offload/host_grads.py); fp32 parameters without master
weights go down to the update and back up, counted as comm's "other" even on a CPU-only machine,
where those copies are no-ops, so `fz.comm_report` reads as a GPU run's. The disk tier's update,
which streams group by group, is fz/step/stream.py.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fz.optim.base import CastGroups
from fz.step.update import GradNorms, apply_optimizer

Params = dict[str, Tensor]


def host_update(spec, comm, local_opt: Any, grads: Params, params: Params, sharded: set[str],
                norms: GradNorms | None = None, cast: Params | None = None, groups: CastGroups | None = None):
    """The optimizer on the host: gradients (and fp32 parameters without master weights) copied
    there and back (counted as comm's "other"); a no-op copy on a CPU-only machine. `cast`:
    parameters in host memory that the update writes as it goes (fz/step/updaters.py: host_casts);
    `groups`: the others, bucket by bucket (fz/offload/landing.py)."""
    host = torch.device("cpu")
    if spec.precision == "fp32" and not comm.params_off:  # no masters: `params` are the device's own
        comm.d2h["other"] += (nbytes := sum(p.numel() * p.element_size() for p in params.values()))
        comm.h2d["other"] += nbytes
    grads = {k: g.to(host, non_blocking=True) for k, g in grads.items()}
    on_host = {k: p.to(host) for k, p in params.items()}
    # norms: of the same values
    new_opt, norm = apply_optimizer(spec, comm, local_opt, grads, on_host, sharded, norms, cast, groups)
    for k, p in params.items():
        if on_host[k] is not p:
            p.copy_(on_host[k], non_blocking=True)
    return new_opt, norm
