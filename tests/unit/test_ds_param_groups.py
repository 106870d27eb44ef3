"""`deepspeed.initialize(model_parameters=groups)` beside the config's optimizer, as DeepSpeed builds
it: the config's optimizer made over the groups, each group's own settings over the config's (torch's
rule), for Adam, AdamW and SGD. Checked against the torch optimizer built that way."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fz
import fz.deepspeed as deepspeed

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 3)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.out(self.norm(torch.tanh(self.lin(x)))), y)


def _batches(n=4):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def _split(model, decay=None):
    """[{weights}, {biases and the norm}]: the second with weight_decay 0, the first with `decay` (None: unset)."""
    named = [(n, p) for n, p in model.named_parameters()]
    first = [p for n, p in named if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in named if not any(p is q for q in first)]
    return [{"params": first, **({} if decay is None else {"weight_decay": decay})},
            {"params": rest, "weight_decay": 0.0}]


CASES = {  # name: (config optimizer, the groups, the torch optimizer DeepSpeed's build amounts to)
    "DeepSpeedExamples' decay and no-decay groups": (
        {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.1}},
        lambda m: _split(m, 0.1),
        lambda groups: torch.optim.AdamW(groups, lr=0.05)),
    "one group overriding the config's decay": (
        {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.5}},
        lambda m: [{"params": list(m.parameters()), "weight_decay": 0.0}],
        lambda groups: torch.optim.AdamW(groups, lr=0.05, weight_decay=0.5)),
    "groups without a decay take the config's": (
        {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.3, "betas": [0.8, 0.9]}},
        lambda m: _split(m),
        lambda groups: torch.optim.AdamW(groups, lr=0.05, weight_decay=0.3, betas=(0.8, 0.9))),
    "SGD with momentum and groups": (
        {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.2}},
        lambda m: _split(m),
        lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.2)),
    "Adam without adam_w_mode": (
        {"type": "Adam", "params": {"lr": 0.05, "weight_decay": 0.1, "adam_w_mode": False}},
        lambda m: _split(m, 0.4),
        lambda groups: torch.optim.Adam(groups, lr=0.05, weight_decay=0.1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_groups_settings_win_over_the_configs(case):
    section, groups, torch_optimizer = CASES[case]
    ref = Net()
    opt = torch_optimizer(groups(ref))
    for x, y in _batches():
        ref(x, y).backward()
        opt.step()
        opt.zero_grad()
    model = Net()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups(model),
                                      config={**CONFIG, "optimizer": section})
    for x, y in _batches():
        engine.backward(engine(x, y))
        engine.step()
    got = dict(engine.module.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p, rtol=1e-5, atol=1e-6)


def test_the_returned_optimizers_groups_show_their_settings_as_deepspeeds_do():
    """DeepSpeed's optimizer.param_groups[i] hold betas, eps, weight_decay, bias_correction besides
    the lr (fz's held the lr only: ["weight_decay"] was a KeyError)."""
    model = Net()
    section = {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.3, "betas": [0.8, 0.9]}}
    _, optimizer, *_ = deepspeed.initialize(model=model, model_parameters=_split(model),
                                            config={**CONFIG, "optimizer": section})
    first, second = optimizer.param_groups
    assert first == {"lr": 0.05, "betas": (0.8, 0.9), "eps": 1e-8, "bias_correction": True, "weight_decay": 0.3}
    assert second["weight_decay"] == 0.0 and second["betas"] == (0.8, 0.9)
    plain = Net()
    _, optimizer, *_ = deepspeed.initialize(model=plain, model_parameters=plain.parameters(),
                                            config={**CONFIG, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert optimizer.param_groups == [{"lr": 0.1, "momentum": 0.0, "dampening": 0.0, "nesterov": False,
                                       "weight_decay": 0.0}]


def test_groups_without_an_optimizer_section_make_an_engine_for_inference():
    """DeepSpeed builds no optimizer from the groups alone (fz made them an AdamW)."""
    model = Net()
    engine, optimizer, *_ = deepspeed.initialize(model=model, model_parameters=_split(model, 0.1), config=CONFIG)
    assert optimizer is None
    x, y = _batches(1)[0]
    with pytest.raises(fz.ConfigError, match="deepspeed.initialize was given no optimizer"):
        engine.backward(engine(x, y))
