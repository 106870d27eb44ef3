"""Restore DeepSpeed's own checkpoints (tests/data/deepspeed/, written by DeepSpeed 0.19.8 at world 2)
into fz at another world size and ZeRO stage, then train on DeepSpeed's next batches.

`import_job(rank, world, stages)` imports each fixture into the fz stages `stages[fixture]`
and returns, per (fixture, stage): whether the weights equal zero_to_fp32's (and the live
engine's masters) exactly, whether the Adam moments equal the engine's exactly, the step and
client state, and the mean loss of the next two steps (the second follows an update that
used the imported moments, step count and lr schedule), which DeepSpeed's record holds too.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from support import ds_models as m

DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed"
ROWS = m.MICRO * m.WORLD  # DeepSpeed's global batch


def _read(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path)) if path.exists() else {}


def _spec(stage: int, precision: str, world: int, grouped: bool = False):
    """The fixture's config at `world`; `grouped`: its weight decay only on the decay group, as
    deepspeed.initialize (fz's too) reads Hugging Face's two groups."""
    import fz
    from fz.optim.from_torch import ClientOptimizer
    cfg = m.ds_config(stage, precision, m.WORLD)
    cfg.update(train_micro_batch_size_per_gpu=ROWS // world, train_batch_size=ROWS)
    auto = {}
    if grouped:
        adam = cfg.pop("optimizer")["params"]
        decay = frozenset(n for n, p in m.TinyLM().named_parameters() if p.requires_grad and not n.endswith(m.NO_DECAY))
        auto = {"lr": adam["lr"], "optimizer": ClientOptimizer("adamw", adam["lr"], tuple(adam["betas"]), adam["eps"],
                                                               adam["weight_decay"], decay)}
    return fz.Spec.from_deepspeed(cfg, **auto).replace(loss_fn=lambda model, tokens: m.lm_loss(model(tokens), tokens))


def _moments(state) -> dict[str, torch.Tensor]:
    from fz.ckpt.deepspeed.importer import _adam_states
    out = {}
    for adam in _adam_states(state.opt_state):
        for kind, field in (("exp_avg", "mu"), ("exp_avg_sq", "nu")):
            for name, leaf in getattr(adam, field).items():
                out[f"{kind}/{name}"] = leaf.full_tensor() if isinstance(leaf, DTensor) else leaf
    return out


def one(name: str, stage: int, rank: int, world: int) -> dict[str, Any]:
    import fz
    src = DATA / name
    record = json.loads((src / "record.json").read_text())
    state = fz.init(m.TinyLM(seed=1), _spec(stage, record["precision"], world, bool(record.get("grouped"))))
    state, client = fz.import_deepspeed(state, src / "ckpt")
    full = fz.full_params(state)
    z2f, engine = _read(src / "zero_to_fp32.safetensors"), _read(src / "engine.safetensors")
    masters = {k.split("/", 1)[1]: v for k, v in engine.items() if k.startswith("fp32/")}
    moments = _moments(state)
    out = {
        "z2f_keys": sorted(z2f), "z2f_equal": all(torch.equal(full[k], v.to(full[k].dtype)) for k, v in z2f.items()),
        "masters_equal": all(torch.equal(full[k], v) for k, v in masters.items()),
        "moments_equal": sorted(k for k in engine if not k.startswith("fp32/")) == sorted(moments)
        and all(torch.equal(moments[k], engine[k]) for k in moments),
        "step": int(state.step), "client_state": client, "losses": [],
    }
    for i in (record["steps"], record["steps"] + 1):
        tokens = torch.cat([m.batch(i, r) for r in range(m.WORLD)])
        per = ROWS // world
        state, loss = fz.train_step(state, tokens[rank * per:(rank + 1) * per])
        out["losses"].append(float(loss))
    return out


def import_job(rank: int, world: int, stages: dict[str, list[int]]) -> dict[tuple[str, int], dict[str, Any]]:
    """`one` for each fixture and each fz stage `stages` lists for it."""
    return {(name, stage): one(name, stage, rank, world) for name, todo in sorted(stages.items()) for stage in todo}
