"""Models with buffers, dict batches and HF-style outputs train like the plain reference."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fz


class MaskedLM(nn.Module):
    """A causal-mask buffer (state, not a parameter) and an HF-style `.loss` output."""

    def __init__(self, vocab=32, dim=16, seq=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq)).bool())
        self.mix = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.out = nn.Linear(dim, vocab)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        t = x.shape[1]
        att = (x @ x.transpose(1, 2)).masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
        x = self.mix(att @ x)
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        logits = self.out(x)
        return SimpleNamespace(loss=F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits=logits)


def _batch(i):
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(0, 32, (4, 8), generator=g)
    return {"input_ids": ids, "labels": ids.roll(-1, 1)}


def _reference_losses(model: nn.Module, steps: int) -> list[float]:
    """Plain PyTorch: AdamW (lr 1e-2, its default weight decay 0.01) over `steps` batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    want = []
    for i in range(steps):
        opt.zero_grad()
        loss = model(**_batch(i)).loss
        loss.backward()
        opt.step()
        want.append(loss.item())
    return want


def test_buffers_dict_batches_and_hf_outputs():
    torch.manual_seed(0)
    want = _reference_losses(MaskedLM(), 5)
    for stage in (0, 3):
        torch.manual_seed(0)
        state = fz.init(MaskedLM(), fz.Spec(stage=stage, optimizer=fz.optim.adamw(lr=1e-2, weight_decay=0.01)))
        assert set(state.buffers) == {"mask"} and state.buffers["mask"].dtype == torch.bool
        got = []
        for i in range(5):
            state, loss = fz.train_step(state, _batch(i))
            got.append(float(loss))
        assert max(abs(a - b) / b for a, b in zip(got, want)) < 1e-5, (stage, got, want)
        out = fz.apply(state, **_batch(0))
        assert out.logits.shape == (4, 8, 32)


def _fused_head(model: nn.Module) -> None:
    """TRL's fused LM head's patch: a method whose closure calls the forward it found."""
    import types

    found = model.forward

    def patched(self, *args, scale=1.0, **kwargs):
        out = found(*args, **kwargs)
        return SimpleNamespace(loss=out.loss * scale, logits=out.logits)

    model.forward = types.MethodType(patched, model)


def _losses_of_state_apart_from_the_model(model: nn.Module, stage: int) -> tuple[list[float], list[float]]:
    """(the patched model's losses, the State's, its original's weights zeroed meanwhile)."""
    want = [model(**_batch(i), scale=2.0).loss.item() for i in range(2)]
    state = fz.init(model, fz.Spec(stage=stage))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # the original's weights: a call reaching them would give another loss
    try:
        return want, [float(fz.apply(state, **_batch(i), scale=2.0).loss) for i in range(2)]
    finally:
        torch.manual_seed(0)
        with torch.no_grad():
            for p, q in zip(model.parameters(), MaskedLM().parameters()):
                p.copy_(q)


def test_a_forward_patched_over_the_original_runs_the_states_weights():
    """A library's patch of `model.forward` (TRL's fused LM head) runs, in fz's copy of the model,
    the copy's own forward on the State's weights: never the original module's, whose weights fz
    does not train."""
    torch.manual_seed(0)
    model = MaskedLM()
    _fused_head(model)
    for stage in (0, 3):
        want, got = _losses_of_state_apart_from_the_model(model, stage)
        assert max(abs(a - b) / b for a, b in zip(got, want)) < 1e-6, (stage, got, want)


def test_a_patched_forward_wrapped_again_runs_the_states_weights():
    """TRL's fused head patched on a reference model, then wrapped by accelerate's mixed precision
    (autocast and an output cast, as `prepare_model` does under bf16): fz's copy calls its own
    weights however deep the original's forward sits in the wrappers."""
    import types

    accelerate_ops = pytest.importorskip("accelerate.utils.operations")
    torch.manual_seed(0)
    model = MaskedLM()
    _fused_head(model)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=False)  # the wrapping, not its numerics
    model.forward = types.MethodType(accelerate_ops.convert_outputs_to_fp32(autocast(model.forward.__func__)), model)
    want, got = _losses_of_state_apart_from_the_model(model, 3)
    assert max(abs(a - b) / b for a, b in zip(got, want)) < 1e-6, (got, want)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_submodule_whose_patched_forward_holds_the_module_trains_in_the_state(stage):
    """TRL's GRPO casts its LM head to fp32 so: `lm_head.forward = f`, `f` reading `lm_head.weight`
    from its closure. fz's copy reads its own head, so the head trains as the reference's does."""
    def patched(model):
        head = model.out

        def cast_forward_to_fp32(x):
            return F.linear(x.to(torch.float32), head.weight.to(torch.float32), head.bias.to(torch.float32))

        head.forward = cast_forward_to_fp32
        return model

    torch.manual_seed(0)
    ref = patched(MaskedLM())
    want = _reference_losses(ref, 4)
    torch.manual_seed(0)
    state = fz.init(patched(MaskedLM()), fz.Spec(stage=stage, optimizer=fz.optim.adamw(lr=1e-2)))
    got = []
    for i in range(4):
        state, loss = fz.train_step(state, _batch(i))
        got.append(float(loss))
    assert max(abs(a - b) / b for a, b in zip(got, want)) < 1e-5, (got, want)
    torch.testing.assert_close(fz.full_params(state)["out.weight"], ref.out.weight.detach(), rtol=1e-5, atol=1e-6)
