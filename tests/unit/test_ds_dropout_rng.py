"""fz.deepspeed's engine draws dropout from the process's generator, as DeepSpeed's eager module
does: a script seeding torch (and drawing between micro-batches) gets the masks, so the losses, of
the same loop in plain PyTorch (DeepSpeed 0.19.8 at world 2 gives these too)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fz.deepspeed as deepspeed

from support.ds_window import Net, batches, window_run


@pytest.mark.parametrize("accumulation", [1, 2])
def test_dropout_masks_are_an_eager_loops(accumulation):
    ref = Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.0)
    torch.manual_seed(5)
    want = []
    for i, (x, y) in enumerate(batches(6)):
        loss = nn.functional.cross_entropy(ref(x), y)
        (loss / accumulation).backward()
        torch.rand(3)  # the script's own draw between micro-batches
        want.append(loss.item())
        if (i + 1) % accumulation == 0:
            opt.step()
            opt.zero_grad()
    after = torch.rand(1)
    model = Net()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accumulation, "gradient_clipping": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    torch.manual_seed(5)
    got = []
    for x, y in batches(6):
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        torch.rand(3)
        engine.step()
        got.append(loss.item())
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert torch.equal(torch.rand(1), after)  # the process's generator left where the eager loop leaves it


@pytest.mark.parametrize("stage", [0, 3])
def test_a_forward_between_micro_batches_in_eval_mode_or_no_grad_runs_on_the_open_updates_weights(stage):
    """DeepSpeed allows it (fz raised): the eval output inside a window is the last update's model's,
    and the updates are those of the loop without it."""
    seen, weights = window_run(stage, True)
    _, plain = window_run(stage, False)
    assert len(seen) == 6
    for inside, after_previous in zip(seen[2::2], seen[1::2]):
        torch.testing.assert_close(inside, after_previous, rtol=0, atol=0)
    for name, w in plain.items():
        torch.testing.assert_close(weights[name], w, rtol=0, atol=0)
