"""`deepspeed.ops.adam.FusedAdam` / `DeepSpeedCPUAdam` on fz (scripts constructing them failed): as a
client optimizer of `deepspeed.initialize` each trains exactly as torch's AdamW (`adam_w_mode`,
the default) or Adam given as the client optimizer; stepped by hand they are torch's; what fz's
Adam does not compute is refused, naming it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fz
import fz.deepspeed as deepspeed
from fz.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0, "zero_optimization": {"stage": 2}}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))


def _train(make_optimizer) -> dict[str, torch.Tensor]:
    model = _net()
    engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(model.parameters()), config=CONFIG)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        engine.step()
    return fz.full_params(engine.state)


@pytest.mark.parametrize("cls", [FusedAdam, DeepSpeedCPUAdam])
@pytest.mark.parametrize("decoupled", [True, False])
def test_trains_as_torchs_adamw_or_adam(cls, decoupled):
    mode = {"adam_w_mode" if cls is FusedAdam else "adamw_mode": decoupled}
    ours = _train(lambda p: cls(p, lr=0.05, weight_decay=0.1, **mode))
    torch_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    theirs = _train(lambda p: torch_cls(p, lr=0.05, weight_decay=0.1))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    plain = _train(lambda p: (torch.optim.Adam if decoupled else torch.optim.AdamW)(p, lr=0.05, weight_decay=0.1))
    assert not all(torch.equal(ours[k], plain[k]) for k in plain)  # the mode decides


def test_stepped_by_hand_it_is_torchs_and_what_fz_does_not_compute_is_refused():
    a, b = _net(), _net()
    opt_a, opt_b = FusedAdam(a.parameters(), lr=0.05, weight_decay=0.1), torch.optim.AdamW(b.parameters(), lr=0.05,
                                                                                          weight_decay=0.1)
    for model, opt in ((a, opt_a), (b, opt_b)):
        model(torch.ones(2, 6)).sum().backward()
        opt.step()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    with pytest.raises(fz.ConfigError, match=r"FusedAdam\(bias_correction=False\): fz's Adam always corrects"):
        FusedAdam(a.parameters(), bias_correction=False)
    with pytest.raises(fz.ConfigError, match=r"DeepSpeedCPUAdam\(amsgrad=True\): not supported"):
        DeepSpeedCPUAdam(a.parameters(), amsgrad=True)
