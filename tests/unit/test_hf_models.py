"""Issue 27: what trying fz on Hugging Face models found (scalar batch leaves, 0-d parameters,
tied weights, the fp32 master in full_params, verbose on the function forms)."""
from __future__ import annotations

import pytest
import torch

import fz
from fz.ckpt import consolidate
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


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))


def _gpt2_loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


@pytest.mark.parametrize("kind", ["fz-gpt", "gpt2"])
@pytest.mark.parametrize("stage", [0, 3])
def test_tied_weights_under_every_name(kind, stage, tmp_path):
    """full_params has exactly the state_dict's names (the tied head as the embedding's tensor),
    and the consolidated file, holding the pair once, loads with safetensors' load_model."""
    from safetensors.torch import load_file, load_model
    make, loss = (make_model, lm_loss) if kind == "fz-gpt" else (_gpt2, _gpt2_loss)
    state = fz.init(make(), spec(stage, 1, loss_fn=loss))
    state, _ = fz.train_step(state, torch.randint(0, 64, (4, 17)))
    full = fz.full_params(state)
    model = make()
    assert set(full) == set(model.state_dict())
    head, emb = ("head.weight", "wte.weight") if kind == "fz-gpt" else ("lm_head.weight", "transformer.wte.weight")
    assert full[head] is full[emb]
    model.load_state_dict(full, strict=True)
    assert model.get_parameter(head) is model.get_parameter(emb) and torch.equal(model.get_parameter(head), full[emb])
    fz.save(state, tmp_path / "ck", verbose=False)
    consolidate(tmp_path / "ck", tmp_path / "m.safetensors", progress=False)
    assert emb in load_file(tmp_path / "m.safetensors") and head not in load_file(tmp_path / "m.safetensors")
    fresh = make()
    load_model(fresh, tmp_path / "m.safetensors", strict=True)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in full.items())


def test_full_params_gives_the_fp32_master_in_bf16():
    state, _ = fz.train_step(fz.init(make_model(), spec(3, 1, precision="bf16")), rank_batches(1, 1, 1)[0][0])
    master = {k: m.full_tensor() for k, m in state.master.items()}
    full = fz.full_params(state)
    assert all(full[k].dtype == torch.float32 and torch.equal(full[k], m) for k, m in master.items())
    compute = fz.full_params(state, dtype="compute")
    assert all(compute[k].dtype == torch.bfloat16 and torch.equal(compute[k], m.bfloat16()) for k, m in master.items())
    cast = fz.full_params(state, dtype=torch.float16)
    assert all(cast[k].dtype == torch.float16 and torch.equal(cast[k], m.half()) for k, m in master.items())
    assert cast["head.weight"] is cast["wte.weight"]
    with pytest.raises(fz.ConfigError, match=r"fz.full_params\(dtype='bf16'\): give None .* or a torch.dtype"):
        fz.full_params(state, dtype="bf16")
