"""One configuration's peak RSS above the baseline, on each rank of a fresh process group.

`measure(rank, world, cfg)` runs under fz.testing.spawn.run_ranks (test_planning.py): the
peak RSS (VmHWM) minus the RSS before fz.init (interpreter, torch, fz and the meta model
loaded), and fz.estimate's prediction for the same configuration.
"""
from __future__ import annotations

import json
import os
import sys


def rss(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(key)


def _warm_up(spec, offload) -> None:
    """One step of a tiny model with the same spec first: what the first step loads once per
    process (lazily imported modules, thread pools: ~30 MB) is not the configuration's memory."""
    import gc

    import fz
    from fz.testing.gpt import GPT, GPTConfig, synthetic_tokens

    tiny = GPTConfig(vocab=64, seq=8, dim=16, heads=2, layers=2)
    if offload is not None and offload.path:
        offload = offload.replace(path=os.path.join(offload.path, "warm-up"), buffer_mb=0.05)
        os.makedirs(offload.path, exist_ok=True)
    state = fz.init(GPT(tiny), spec.replace(offload=offload))
    state, loss = fz.train_step(state, synthetic_tokens(2, tiny.seq, tiny.vocab, seed=0))
    float(loss)
    del state, loss
    gc.collect()


def measure(rank: int, world: int, cfg: dict) -> dict:
    import torch

    import fz
    from fz.testing.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens

    torch.set_num_threads(1)
    gpt = GPTConfig(**cfg["gpt"])
    with torch.device("meta"):
        model = GPT(gpt)
    offload = cfg.get("offload")
    if offload == "cpu":
        offload = fz.offload.cpu()
    elif offload == "nvme":
        path = os.path.join(cfg["path"], f"rank{rank}")
        os.makedirs(path, exist_ok=True)
        offload = fz.offload.nvme(path, params=True, buffer_mb=cfg.get("buffer_mb", 32))
    spec = fz.Spec(stage=cfg["stage"], precision=cfg["precision"], loss_fn=lm_loss, offload=offload,
                   activation_checkpointing=cfg.get("ac", False), clip_grad_norm=1.0)
    micro = cfg["micro"]
    data = synthetic_tokens(micro * cfg["steps"], gpt.seq, gpt.vocab, seed=rank)
    est = fz.estimate(model, spec=spec, micro_batch=micro, seq_len=gpt.seq + 1, world_size=world)
    _warm_up(spec, offload)
    base = rss("VmRSS")
    state = fz.init(model, spec)
    for i in range(cfg["steps"]):
        state, loss = fz.train_step(state, data[i * micro:(i + 1) * micro])
    float(loss)
    return {"peak": rss("VmHWM") - base, "predicted": est.one_memory,
            "states": est.model_states, "activations": est.activations}


def measure_plan(rank: int, world: int, cfg: dict) -> dict:
    """fz.plan under a budget (memory per node, shared by its ranks), then its Spec trained: the peak."""
    import torch

    import fz
    from fz.testing.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens

    torch.set_num_threads(1)
    gpt = GPTConfig(**cfg["gpt"])
    with torch.device("meta"):
        model = GPT(gpt)
    path = os.path.join(cfg["path"], f"rank{rank}")
    os.makedirs(path, exist_ok=True)
    spec = fz.plan(model, spec=fz.Spec(loss_fn=lm_loss, clip_grad_norm=1.0), world_size=world,
                   host_budget=cfg["budget"], disk_budget=cfg.get("disk", 2**40),  # no device budget: device = host
                   micro_batch=cfg["micro"], seq_len=gpt.seq + 1, nvme_path=path)
    micro = cfg["micro"]
    data = synthetic_tokens(micro * 2, gpt.seq, gpt.vocab, seed=rank)
    base = rss("VmRSS")
    state = fz.init(model, spec)
    for i in range(2):
        state, loss = fz.train_step(state, data[i * micro:(i + 1) * micro])
    float(loss)
    off = spec.offload
    return {"peak": rss("VmHWM") - base, "stage": spec.stage, "precision": spec.precision,
            "offload": off and (off.optimizer, off.params), "ac": spec.activation_checkpointing}


if __name__ == "__main__":  # by hand: python tests/support/peak_worker.py WORLD '{"stage": 0, ...}'
    from fz.testing.spawn import run_ranks
    print(json.dumps(run_ranks(int(sys.argv[1]), measure, json.loads(sys.argv[2]))))
