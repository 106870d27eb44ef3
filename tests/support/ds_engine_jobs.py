"""Seed 003's DeepSpeed loop, run with `deepspeed` being fz.deepspeed or DeepSpeed itself.

    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=params,
                                                training_data=data)
    for step, batch in enumerate(loader):
        loss = engine(batch); engine.backward(loss); engine.step()
        if step % save_interval == 0: engine.save_checkpoint(save_dir, ckpt_id, client_sd=client_sd)
    _, client_sd = engine.load_checkpoint(load_dir, ckpt_id); step = client_sd["step"]
    dataloader_to_step(data_loader, step + 1)

`loop` is that script, as a function of the module: tests run it under fz at world 2 and
compare with the same function under DeepSpeed, whose losses, lrs and weights
tests/data/deepspeed_seed003.json holds; with DeepSpeed installed,
`DS_ACCELERATOR=cpu python tests/support/ds_engine_jobs.py tests/data/deepspeed_seed003.json`
writes them anew.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
from torch import nn

STEPS, SAVE_AT, MICRO, ACCUM, ROWS = 4, 2, 2, 2, 48


class LossModel(nn.Module):
    """model(batch) -> loss, as seed 003's engine(batch) wants it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.body(batch["x"])), batch["y"])


class Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(ROWS, 8, generator=g), torch.randint(0, 4, (ROWS,), generator=g)

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


def config(stage: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                         "warmup_num_steps": 2}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 1000}


def dataloader_to_step(loader, step: int):
    it = iter(loader)
    for _ in range(step):
        next(it)
    return it


def loop(deepspeed, stage: int, save_dir: str, load: bool) -> dict[str, Any]:
    """Train to STEPS updates (saving at SAVE_AT), or resume from save_dir's checkpoint and finish."""
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed"])
    model = LossModel()
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                training_data=Data(), config=config(stage))
    if hasattr(loader, "num_local_io_workers"):  # DeepSpeed's loader: no worker processes inside a daemon rank
        loader.num_local_io_workers = 0
    start, losses, lrs, means = 0, [], [], []
    if load:
        _, client_sd = engine.load_checkpoint(save_dir, "ckpt")
        start = client_sd["step"]
    it = dataloader_to_step(loader, start * ACCUM)
    for micro in range(start * ACCUM, STEPS * ACCUM):
        batch = next(it)
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        if (micro + 1) % ACCUM == 0:
            lrs.append(engine.get_lr()[0])
            if type(engine).__module__.startswith("fz."):  # the update's loss, averaged over ranks
                means.append(float(engine.losses))
        if (micro + 1) == SAVE_AT * ACCUM and not load:
            engine.save_checkpoint(save_dir, "ckpt", client_state={"step": SAVE_AT})
    weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "lrs": lrs, "global_steps": engine.global_steps, "weights": weights,
            "stage": engine.zero_optimization_stage(), "mean_losses": means}


def train_step_reference(stage: int) -> dict[str, Any]:
    """The same updates by fz.train_step: each step's batch is the loader's ACCUM micro-batches."""
    import fz
    from fz.deepspeed.initialize import EngineDataLoader
    spec = fz.Spec.from_deepspeed(config(stage)).replace(loss_fn=lambda model, b: model(b))
    state = fz.init(LossModel(), spec)
    it = iter(EngineDataLoader(Data(), MICRO, state.plan.rank, len(state.plan.ranks), None, False))
    losses = []
    for _ in range(STEPS):
        micro = [next(it) for _ in range(ACCUM)]
        state, loss = fz.train_step(state, {k: torch.cat([m[k] for m in micro]) for k in micro[0]})
        losses.append(float(loss))
    return {"losses": losses, "weights": fz.full_params(state)}


def own_init(deepspeed) -> dict[str, torch.Tensor]:
    """A script seeding each rank differently: after initialize (ZeRO-1) every rank's own model
    holds rank 0's weights, as DeepSpeed broadcasts them into the module."""
    import torch.distributed as dist
    torch.manual_seed(dist.get_rank())
    model = nn.Linear(4, 3)
    deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(1))
    return {k: v.clone() for k, v in model.state_dict().items()}


def own_buffers(deepspeed) -> tuple[torch.Tensor, torch.Tensor]:
    """BatchNorm's running mean after two updates on this rank's own rows, and an eager BatchNorm's
    on the same rows: DeepSpeed syncs no module buffer, so each rank keeps its own."""
    import torch.distributed as dist
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 2))
    eager = nn.BatchNorm1d(4)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(1))
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    for _ in range(2 * ACCUM):
        x = torch.randn(MICRO, 4, generator=g) * (1 + dist.get_rank())
        eager(x)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    return dict(engine.module.named_buffers())["0.running_mean"].clone(), eager.running_mean.clone()


def fragments(deepspeed, stage: int) -> dict[str, torch.Tensor]:
    """A weight's full fp32 master and Adam moment through deepspeed.utils (at ZeRO-3 gathered from
    both ranks' shards; at ZeRO-1 the parameter is whole on each), fz.full_params', and a bias set."""
    import fz
    from fz.deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param
    model = LossModel()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage))
    for i in range(ACCUM * 2):
        engine.backward(engine({"x": torch.randn(MICRO, 8, generator=torch.Generator().manual_seed(i)),
                                "y": torch.tensor([i % 4] * MICRO)}))
        engine.step()
    weight = model.body[0].weight
    out = {"fp32": safe_get_full_fp32_param(weight), "exp_avg": safe_get_full_optimizer_state(weight, "exp_avg"),
           "full": fz.full_params(engine.state)["body.0.weight"]}
    safe_set_full_fp32_param(model.head.bias, torch.arange(4.0))
    out["set"] = fz.full_params(engine.state)["head.bias"]
    return out


def grads(deepspeed, stage: int) -> dict[str, Any]:
    """A weight's `.grad` after each micro-batch's backward of the first update and
    safe_get_full_grad at its boundary, with an eager model's: this rank's own micro-batch
    gradient / ACCUM, and the average over ranks of each rank's sum."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()

    def micro(r: int, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(100 + 10 * i + r)
        return {"x": torch.randn(MICRO, 8, generator=g), "y": torch.randint(0, 4, (MICRO,), generator=g)}

    def eager(batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        m = LossModel()
        for b in batches:
            (m(b) / ACCUM).backward()
        return m.head.weight.grad.clone()

    model = LossModel()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage))
    from fz.deepspeed.utils import safe_get_full_grad
    shown = []
    for i in range(ACCUM):
        engine.backward(engine(micro(rank, i)))
        shown.append(None if model.head.weight.grad is None else model.head.weight.grad.clone())
        if i == ACCUM - 1:  # at the boundary, before its update
            full = safe_get_full_grad(model.head.weight).clone()
        engine.step()
    return {"shown": shown, "full": full, "after": model.head.weight.grad, "own": eager([micro(rank, 0)]),
            "mean": sum(eager([micro(r, i) for i in range(ACCUM)]) for r in range(world)) / world}


def fz_job(rank: int, world: int, save_root: str) -> dict[Any, Any]:
    import fz.deepspeed as deepspeed

    from support.ds_window import window_run
    out: dict[Any, Any] = {"own_init": own_init(deepspeed), "window": (window_run(3, True), window_run(3, False)),
                           "own_buffers": own_buffers(deepspeed),
                           "fragments": {s: fragments(deepspeed, s) for s in (1, 3)},
                           "grads": {s: grads(deepspeed, s) for s in (0, 1, 2, 3)}}
    for stage in (0, 1, 2, 3):
        d = os.path.join(save_root, f"stage{stage}")
        out[stage] = {"run": loop(deepspeed, stage, d, load=False), "resumed": loop(deepspeed, stage, d, load=True),
                      "train_step": train_step_reference(stage)}
    return out


def deepspeed_job(rank: int, world: int, save_root: str) -> dict[int, Any]:
    import deepspeed
    out = {}
    for stage in (0, 1, 2, 3):
        out[stage] = {"run": loop(deepspeed, stage, os.path.join(save_root, f"stage{stage}"), load=False)}
    return out


if __name__ == "__main__":  # with DeepSpeed installed: DS_ACCELERATOR=cpu python ds_engine_jobs.py OUT.json
    import tempfile

    from fz.testing.spawn import run_ranks
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        got = run_ranks(2, deepspeed_job, tmp, timeout=600)
    record = {str(s): {"losses": got[0][s]["run"]["losses"], "lrs": got[0][s]["run"]["lrs"],
                       "weights": {n: w.tolist() for n, w in got[0][s]["run"]["weights"].items()}}
              for s in got[0]}
    with open(sys.argv[1], "w") as f:
        json.dump(record, f)
