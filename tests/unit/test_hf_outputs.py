"""Outputs that transformers records with forward hooks, installed on the first forward by walking
the model's children (router logits, hidden states, attentions): under fz the walk finds each
block where it was (its class, its children), so the hooks are installed and called, as in torch."""
from __future__ import annotations

import copy

import pytest
import torch

import fz

from support.helpers import max_rel
from support.real_nets import hf_loss, hf_model, reference, tokens

tr = pytest.importorskip("transformers")


def _mixtral():
    return hf_model("mixtral")


def _llama():
    torch.manual_seed(0)
    return tr.LlamaForCausalLM(tr.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, attn_implementation="eager"))


def _spec(stage: int) -> fz.Spec:
    return fz.Spec(stage=stage, optimizer=fz.optim.adamw(lr=1e-2, weight_decay=0.01), loss_fn=hf_loss)


def test_mixtral_router_logits_give_the_load_balancing_loss_as_in_torch():
    data = [tokens(i, 4, "mixtral") for i in range(3)]
    want, _ = reference(_mixtral, hf_loss, data, 1)
    with torch.no_grad():
        first = _mixtral()(**data[0])
    assert first.aux_loss is not None and float(first.aux_loss) > 0  # the loss has the load-balancing term
    for stage in (0, 3):
        state = fz.init(_mixtral(), _spec(stage))
        assert max_rel([float(fz.eval_step(state, data[0]))], [float(first.loss)]) < 1e-5, stage
        got = []
        for batch in data:
            state, loss = fz.train_step(state, batch)
            got.append(float(loss))
        assert max_rel(got, want) < 1e-5, (stage, got, want)
        out = fz.apply(state, **data[0])
        assert out.router_logits is not None and len(out.router_logits) == 2, stage
    state = fz.init(_mixtral(), fz.Spec(stage=3, optimizer=fz.optim.adamw(lr=1e-2, weight_decay=0.01),
                                        loss_fn=hf_loss, precision="bf16"))
    state, loss = fz.train_step(state, data[0])
    assert abs(float(loss) - want[0]) / want[0] < 2e-2


def test_apply_returns_every_hidden_state_and_attention_as_torch_does():
    ids = tokens(0, 4, "llama")["input_ids"]
    want = _llama()(input_ids=ids, output_hidden_states=True, output_attentions=True)
    for stage in (0, 3):
        state = fz.init(_llama(), _spec(stage))
        for _ in range(2):  # the hooks are installed once, on the first forward, and called every time
            got = fz.apply(state, input_ids=ids, output_hidden_states=True, output_attentions=True)
            assert len(got.hidden_states) == len(want.hidden_states) == 3, stage
            assert len(got.attentions) == len(want.attentions) == 2, stage
            for a, b in zip(got.hidden_states + got.attentions, want.hidden_states + want.attentions):
                assert torch.allclose(a, b, atol=1e-6), stage
        plain = fz.apply(state, input_ids=ids)  # not asked for: not recorded
        assert plain.hidden_states is None and plain.attentions is None


def test_a_stand_in_passes_for_its_block_and_keeps_its_hooks():
    state = fz.init(_llama(), _spec(3))
    root = state.skeleton.root
    layer = root.model.layers[0]
    assert isinstance(layer, tr.models.llama.modeling_llama.LlamaDecoderLayer)
    assert [n for n, _ in layer.named_children()] == [n for n, _ in _llama().model.layers[0].named_children()]
    assert not any(".layers." in n for n, _ in root.named_parameters())  # the blocks' tensors stay fz's
    seen = []
    handle = layer.register_forward_hook(lambda m, args, out: seen.append(out[0].shape if isinstance(out, tuple)
                                                                           else out.shape))
    fz.apply(state, input_ids=tokens(0, 4, "llama")["input_ids"])
    handle.remove()
    assert seen == [torch.Size([4, 8, 32])]
    copy.deepcopy(root)  # a copy of the skeleton still works


class _Counting:
    """A hook object (and a tracker whose method is a hook): what they keep must be the user's."""

    def __init__(self):
        self.calls, self.shapes = 0, []

    def __call__(self, module, args, out):
        self.calls += 1

    def record(self, module, args, out):
        self.shapes.append(tuple(out.shape))


@pytest.mark.parametrize("stage", [0, 3])
def test_hook_objects_on_the_model_are_the_users_not_copies(stage):
    """fz's copy of the model deep-copied them: a callable object's count and a bound method's records
    stayed 0 on the user's objects (a closure's always counted)."""
    model, counting, tracker, closure = _llama(), _Counting(), _Counting(), []
    model.model.layers[0].mlp.register_forward_hook(counting)  # inside a block
    model.lm_head.register_forward_hook(tracker.record)  # at the root
    model.model.norm.register_forward_hook(lambda m, a, o: closure.append(1))
    state = fz.init(model, _spec(stage))
    ids = tokens(0, 4, "llama")["input_ids"]
    for _ in range(2):
        fz.apply(state, input_ids=ids)
    assert counting.calls == len(closure) == 2 and tracker.shapes == [(4, 8, model.config.vocab_size)] * 2


def test_a_hook_object_that_holds_the_model_is_copied_with_it():
    """transformers' DebugUnderflowOverflow keys its module names by module: shared with fz's copy, it was
    a KeyError on the copy's modules; it is copied with the model, as before hook objects were shared."""
    from transformers.debug_utils import DebugUnderflowOverflow
    model = _llama()
    DebugUnderflowOverflow(model)
    state = fz.init(model, _spec(0))
    out = fz.apply(state, input_ids=tokens(0, 4, "llama")["input_ids"])
    assert torch.isfinite(out.logits).all()
