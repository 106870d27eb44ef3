"""Jobs of tests/cuda/test_cuda.py that run in their own process: the CPU reference (with
CUDA hidden) and the world-2 run on one GPU through gloo."""
from __future__ import annotations

import json
import os
import sys

STEPS = 3
KINDS = ("none", "cpu", "nvme")


def policy(kind: str, path: str, params: bool):
    import fz
    if kind == "none":
        return None
    if kind == "cpu":
        return fz.offload.cpu(params=params)
    os.makedirs(path, exist_ok=True)
    return fz.offload.nvme(path, params=params, buffer_mb=0.05, buffers=3, prefetch=2)


def cases():
    """(stage, offload kind, params offloaded, precision) of the world-1 comparison."""
    out = []
    for stage in range(4):
        for kind in KINDS:
            for params in ((False, True) if stage == 3 and kind != "none" else (False,)):
                for precision in ("fp32", "bf16"):
                    out.append((stage, kind, params, precision))
    return out


def losses(root: str) -> dict:
    """{case: the 3 losses, or the ConfigError's first line} on this process's device."""
    import fz

    from support.helpers import make_model, rank_batches, spec

    batches = rank_batches(1, 1, STEPS)
    out = {}
    for stage, kind, params, precision in cases():
        key = f"{stage}-{kind}-{params}-{precision}"
        try:
            sp = spec(stage, 1, precision=precision,
                      offload=policy(kind, os.path.join(root, key), params))
            state = fz.init(make_model(), sp)
        except fz.ConfigError as e:
            out[key] = str(e).splitlines()[0]
            continue
        got = []
        for b in batches[:STEPS]:
            state, loss = fz.train_step(state, b[0])
            got.append(float(loss))
        out[key] = got
    return out


def gloo_world2(rank: int, world: int, stage: int) -> list:
    """Two ranks on the one GPU through gloo (NCCL refuses two ranks on one device)."""
    import fz
    import fz.distributed

    from support.helpers import make_model, rank_batches, spec

    fz.distributed.init(backend="gloo")
    state = fz.init(make_model(), spec(stage, 1))
    out = []
    for b in rank_batches(world, 1, STEPS):
        state, loss = fz.train_step(state, b[rank])
        out.append(float(loss))
    return [str(state.plan.device), out]


if __name__ == "__main__":  # python tests/support/cuda_jobs.py ROOT: the CPU reference's losses as JSON
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    print(json.dumps(losses(sys.argv[1])))
