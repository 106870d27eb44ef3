"""Issue 27: what trying fz on Hugging Face models found (scalar batch leaves, 0-d parameters,
tied weights, the fp32 master in full_params, verbose on the function forms)."""
from __future__ import annotations

import pytest
import torch

import fz
from fz.testing.gpt import lm_loss

from support.helpers import make_model, rank_batches, spec


def _scalar_loss(model, batch):
    assert batch["n"].dim() == 0 and batch["n"].item() == 7.0 and batch["w"] == 0.5
    return lm_loss(model, batch["tokens"])


@pytest.mark.parametrize("stage", [0, 3])
def test_batch_scalars_pass_through(stage):
    """A 0-d tensor (transformers' num_items_in_batch) and a float ride along to every micro-batch."""
    batches = rank_batches(1, 2, 2)
    ref = fz.init(make_model(), spec(stage, 2))
    state = fz.init(make_model(), spec(stage, 2, loss_fn=_scalar_loss))
    for per_rank in batches:
        ref, want = fz.train_step(ref, per_rank[0])
        batch = {"tokens": per_rank[0], "n": torch.tensor(7.0), "w": 0.5}
        state, got = fz.train_step(state, batch)
        assert float(got) == float(want)


def test_batch_of_only_scalars_is_refused():
    state = fz.init(make_model(), spec(0, 1, loss_fn=lambda m, b: b["n"]))
    with pytest.raises(fz.ConfigError, match=r"no tensor with a batch \(leading\) dimension.*shape \(rows, \.\.\.\)"):
        fz.train_step(state, {"n": torch.tensor(1.0), "w": 0.5})


def test_batch_leading_sizes_disagree():
    state = fz.init(make_model(), spec(0, 1))
    with pytest.raises(fz.ConfigError, match=r"same leading \(batch\) dimension; got \[3, 4\].*same rows"):
        fz.train_step(state, {"x": torch.zeros(4, 8, dtype=torch.long), "y": torch.zeros(3), "n": torch.tensor(2)})


def test_save_and_restore_take_verbose(tmp_path, capsys):
    state = fz.init(make_model(), spec(0, 1))
    fz.save(state, tmp_path / "c", verbose=False)
    state = fz.restore(state, tmp_path / "c", verbose=False)
    assert "fz: " not in capsys.readouterr().out
    fz.save(state, tmp_path / "d")
    fz.restore(state, tmp_path / "d")
    out = capsys.readouterr().out
    assert "fz: saved " in out and "fz: restored " in out
