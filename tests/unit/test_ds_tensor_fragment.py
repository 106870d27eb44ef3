"""deepspeed.utils.safe_get_full_fp32_param / safe_get_full_optimizer_state / safe_set_full_fp32_param
on fz's engine, against torch's AdamW over the same loop (world 1; world 2 at ZeRO-3:
tests/multirank/test_ds_engine.py), and safe_get_full_grad between a backward and its update."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fz
import fz.deepspeed as deepspeed
from fz.deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _batches(n=3):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_full_master_and_moments_are_the_updates_and_a_set_reaches_the_training(precision):
    ref = Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.0)
    for x, y in _batches():
        nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    model = Net()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0, "bf16": {"enabled": precision == "bf16"},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for x, y in _batches():
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        engine.step()
    weight = model.a.weight
    tol = dict(rtol=1e-5, atol=1e-6) if precision == "fp32" else dict(rtol=0.05, atol=2e-3)
    assert safe_get_full_fp32_param(weight).dtype == torch.float32
    torch.testing.assert_close(safe_get_full_fp32_param(weight), ref.a.weight.detach(), **tol)
    torch.testing.assert_close(safe_get_full_fp32_param(weight), fz.full_params(engine.state)["a.weight"])
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(safe_get_full_optimizer_state(weight, key), opt.state[ref.a.weight][key], **tol)
    safe_set_full_fp32_param(model.b.bias, torch.full((3,), 0.5))
    assert torch.equal(fz.full_params(engine.state)["b.bias"], torch.full((3,), 0.5))
    assert torch.equal(model.b.bias.detach().float(), torch.full((3,), 0.5))  # the script's model reads it too
    with pytest.raises(fz.ConfigError, match="holds NaN or inf"):
        safe_set_full_fp32_param(model.b.bias, torch.full((3,), float("nan")))
    assert safe_get_full_grad(weight) is None  # outside an accumulation window: fz keeps none after its update
    x, y = _batches(4)[-1]
    with torch.no_grad():
        ref.b.bias.fill_(0.5)  # as set above
    nn.functional.cross_entropy(ref(x), y).backward()
    engine.backward(nn.functional.cross_entropy(engine(x), y))  # the boundary's: before its update, the gradient
    torch.testing.assert_close(safe_get_full_grad(weight), ref.a.weight.grad, **tol)
    engine.step()
    with pytest.raises(fz.ConfigError, match="not a parameter of a model deepspeed.initialize was given"):
        safe_get_full_fp32_param(nn.Parameter(torch.zeros(2)))
