"""fz.deepspeed at world 2, ZeRO-2 in bf16: the script's model read on one rank only (DeepSpeed's
`if rank == 0:` idioms) is local, the values the engine computes with."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.out(torch.tanh(self.lin(x))), y)


def one_rank_reads(rank: int, world: int, save_dir: str) -> dict[str, Any]:
    import fz
    import fz.deepspeed as deepspeed
    model = Net()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(3)
    lone = ""
    for i in range(2):
        if i == 1 and rank == 0:  # a collective read alone (logging a master's norm): fails in seconds, not a hang
            from fz.deepspeed.utils import safe_get_full_fp32_param
            try:
                safe_get_full_fp32_param(model.lin.weight)
            except fz.ConfigError as e:
                lone = str(e)
        x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        engine.backward(engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
        engine.step()
    read: dict[str, torch.Tensor] = {}
    if rank == 0:  # alone: a collective here would wait for rank 1, which is past it
        read = {n: p.detach().clone() for n, p in model.named_parameters()}
        read.update({f"sd.{k}": v.clone() for k, v in model.state_dict().items()})
    compute = fz.full_params(engine.state, dtype="compute")  # every rank
    # DeepSpeed's `if rank == 0: engine.save_checkpoint(...)` then `deepspeed.comm.barrier()`: the lone save sees
    # rank 1 waiting in the barrier and fails in seconds (it waited out Spec.timeout_s), then both pass the barrier
    saved = ""
    if rank == 0:
        try:
            engine.save_checkpoint(save_dir)
        except fz.ConfigError as e:
            saved = str(e)
    deepspeed.comm.barrier()
    return {"read": read, "compute": {k: v.float() for k, v in compute.items()}, "lone": lone, "saved": saved}
