"""A DeepSpeed loop with dropout, for fz.deepspeed's draws and its forwards between micro-batches
(tests/unit/test_ds_dropout_rng.py at world 1, tests/multirank/test_ds_engine.py at world 2)."""
from __future__ import annotations

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.drop = nn.Linear(8, 16), nn.Linear(16, 4), nn.Dropout(0.5)

    def forward(self, x):
        return self.b(self.drop(torch.tanh(self.a(x))))


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(n)]


def window_run(stage: int, look: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Three updates of two micro-batches; with `look`, an eval-mode and a train-mode no_grad forward
    between each update's micro-batches, as a script counting its eval interval in micro-batches does."""
    import fz
    import fz.deepspeed as deepspeed
    model = Net()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0,
              "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    probe = torch.randn(3, 8, generator=torch.Generator().manual_seed(9))
    seen = []
    torch.manual_seed(5)
    for i, (x, y) in enumerate(batches(6)):
        if look and i % 2 == 1:
            engine.eval()
            with torch.no_grad():
                seen.append(engine(probe))
            engine.train()
            with torch.random.fork_rng(), torch.no_grad():
                engine(probe)  # train mode under no_grad: dropout, nothing for the step
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        engine.step()
        if look and i % 2 == 1:
            engine.eval()
            with torch.no_grad():
                seen.append(engine(probe))  # after the update, outside a window: fz.apply
            engine.train()
    return seen, {k: v.detach().clone() for k, v in fz.full_params(engine.state).items()}
