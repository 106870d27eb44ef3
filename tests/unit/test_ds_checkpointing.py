"""`deepspeed.checkpointing` on fz (Megatron-style models call it in their forward; it was an
AttributeError): `checkpoint(block, h)` trains exactly as the same model without it, recomputing the
block in backward at every stage;
`configure` takes what means the same without model parallelism and refuses, naming them, what fz does not do."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fz
import fz.deepspeed as deepspeed

CALLS = [0]  # a block's forwards, counted wherever fz runs it (its skeleton is a copy of the model)


class Net(nn.Module):
    def __init__(self, checkpointed: bool):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(8, 2)
        self.checkpointed = checkpointed

    def block(self, i: int, h: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        CALLS[0] += 1
        return self.blocks[i](h) * scale

    def forward(self, x, y):
        h = x
        for i in range(len(self.blocks)):
            h = deepspeed.checkpointing.checkpoint(self.block, i, h, scale=1.0) if self.checkpointed \
                else self.block(i, h)
        return nn.functional.cross_entropy(self.head(h), y)


def _train(stage: int, checkpointed: bool):
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}}
    model = Net(checkpointed)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(1)
    losses = []
    CALLS[0] = 0
    for _ in range(3):
        loss = engine(torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses, fz.full_params(engine.state), CALLS[0]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_checkpointed_block_trains_as_without_and_is_recomputed(stage):
    """At stage 3 too: fz's gather used to take the block's saved tensors there (kept, never recomputed)."""
    plain, plain_weights, plain_calls = _train(stage, False)
    ours, weights, calls = _train(stage, True)
    assert ours == plain
    assert all(torch.equal(weights[k], plain_weights[k]) for k in plain_weights)
    assert (plain_calls, calls) == (9, 18)  # 3 blocks x 3 steps, each recomputed in backward


def test_configure_takes_what_means_the_same_and_refuses_the_rest():
    deepspeed.checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {
        "partition_activations": True, "contiguous_memory_optimization": False, "profile": True}})
    assert deepspeed.checkpointing.is_configured()
    with pytest.raises(fz.ConfigError, match=r"checkpoint_in_cpu \(cpu_checkpointing\) is not done by fz"):
        deepspeed.checkpointing.configure(None, {"activation_checkpointing": {"cpu_checkpointing": True}})
    with pytest.raises(fz.ConfigError, match=r"an mpu \(model parallelism\) is not fz's"):
        deepspeed.checkpointing.configure(object())


def test_configure_reads_a_config_path_as_spec_from_deepspeed_reads_it(tmp_path):
    """A FIFO is refused unread (open() + json.load blocked forever), a repeated key is refused (json
    keeps the last), nesting and bad text are ConfigErrors naming the file; a good file is read."""
    import json
    import os
    good = tmp_path / "ds.json"
    good.write_text(json.dumps({"activation_checkpointing": {"partition_activations": True}}))
    deepspeed.checkpointing.configure(None, str(good))
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "dup.json").write_text('{"activation_checkpointing": {"cpu_checkpointing": true, '
                                       '"cpu_checkpointing": false}}')
    (tmp_path / "deep.json").write_text("[" * 5000 + "]" * 5000)
    for name, words in [("fifo.json", "not a regular file"), ("dup.json", "appears twice"),
                        ("deep.json", "nests deeper"), ("missing.json", "No such file")]:
        with pytest.raises(fz.ConfigError, match=words):
            deepspeed.checkpointing.configure(None, str(tmp_path / name))
