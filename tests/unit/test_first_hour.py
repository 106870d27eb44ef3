"""A new user's first mistakes get an error naming the cause and the fix (issue 29): the wrong
object where a State goes, a Spec keyword typo, a model the default loss cannot call."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

import fz


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x)


BATCH = {"x": torch.randn(3, 4), "y": torch.randint(0, 2, (3,))}
EXPECTS = r"takes an fz\.State \(made by `fz\.init\(model, spec\)`\) as its state; it got "


@pytest.fixture(scope="module")
def state():
    return fz.init(Net(), fz.Spec(stage=0))


@pytest.mark.parametrize("call, given, says", [
    (lambda x: fz.train_step(x, BATCH), Net(), r"a model \(test_first_hour\.Net\): make the state once with "
                                               r"`state = fz\.init\(model, spec\)`"),
    (lambda x: fz.train_step(x, BATCH), fz.Spec(), r"an fz\.Spec: make the state once"),
    (lambda x: fz.train_step(x, BATCH), None, r"None \(was the state assigned from a function that returns nothing"),
    (lambda x: fz.eval_step(x, BATCH), [], r"a list$"),
    (lambda x: fz.apply(x, BATCH["x"]), Net(), r"a model"),
    (lambda x: fz.memory_report(x), "state", r"a str$"),
    (lambda x: fz.full_params(x), Net(), r"a model"),
], ids=["train_step-model", "train_step-spec", "train_step-None", "eval_step-list", "apply-model",
        "memory_report-str", "full_params-model"])
def test_the_wrong_object_where_a_state_goes_is_named(call, given, says):
    with pytest.raises(fz.ConfigError, match=EXPECTS + says):
        call(given)


def test_the_train_step_tuple_is_named(state):
    with pytest.raises(fz.ConfigError, match=r"^fz\.apply " + EXPECTS + r"a tuple: fz\.train_step returns \(state, "
                                             r"loss\); write `state, loss = fz\.train_step\(state, batch\)`"):
        fz.apply((state, torch.tensor(1.0)), BATCH["x"])


def test_a_spec_keyword_typo_says_did_you_mean():
    with pytest.raises(fz.ConfigError, match=r"^Spec\(micro_bach=\.\.\.\): no such field \(did you mean "
                                             r"'micro_batch'\?\); the fields are stage, shard_group_size, "):
        fz.Spec(micro_bach=3)
    with pytest.raises(fz.ConfigError, match=r"did you mean 'grad_accum'"):
        fz.Spec(stage=1).replace(grad_acum=2)


def test_a_model_the_default_loss_cannot_call_names_loss_fn(state):
    with pytest.raises(fz.ConfigError, match=r"^the Spec has no loss_fn, so fz called model\(\*\*batch\) with keys "
                                             r"\['x', 'y'\], and the model's forward refused it \(.*unexpected "
                                             r"keyword argument 'y'\)\. Set Spec\(loss_fn=fn\).* \(a forward "
                                             r"that takes the dict whole, .*`lambda model, b: model\(b\)`\)$"):
        fz.train_step(state, BATCH, donate=False)
    good = fz.init(Net(), fz.Spec(loss_fn=lambda m, b: nn.functional.cross_entropy(m(b["x"]), b["y"])))
    _, loss = fz.train_step(good, BATCH)
    assert torch.isfinite(loss)


def test_a_model_given_to_save_or_restore_is_named(tmp_path, state):
    with pytest.raises(fz.ConfigError, match=r"^fz\.save " + EXPECTS + r"a model \(test_first_hour\.Net\)"):
        fz.save(Net(), tmp_path)
    with pytest.raises(fz.ConfigError, match=r"^fz\.restore " + EXPECTS + r"a model"):
        fz.restore(tmp_path, Net())  # the old order, with a model for the state
    with pytest.raises(fz.ConfigError, match=r"^fz\.restore " + EXPECTS + r"an fz\.Spec"):
        fz.restore(fz.Spec(), tmp_path)
    with pytest.raises(fz.ConfigError, match=r"^Checkpointer\.save " + EXPECTS + r"None"):
        fz.Checkpointer(tmp_path).save(None)


def test_restoring_a_step_that_is_not_there_lists_the_steps(tmp_path):
    fz.save(fz.init(Net(), fz.Spec()), tmp_path)
    with pytest.raises(fz.CheckpointError, match=r"^no checkpoint .*step_7: there is no step 7 in .* \(committed "
                                                 r"steps: \[0\]\)$"):
        fz.restore(fz.init(Net(), fz.Spec()), tmp_path / "step_7")


def test_a_folder_holding_a_checkpoint_one_level_down_names_it(tmp_path):
    """A Trainer's checkpoint-N/ keeps fz's checkpoint in checkpoint-N/fz."""
    fz.save(fz.init(Net(), fz.Spec()), tmp_path / "checkpoint-4" / "fz")
    (tmp_path / "checkpoint-4" / "trainer_state.json").write_text("{}")
    with pytest.raises(fz.CheckpointError, match=r"checkpoint-4 holds no committed checkpoint; a checkpoint is inside "
                                                 r"it: pass .*checkpoint-4/fz$"):
        fz.restore(fz.init(Net(), fz.Spec()), tmp_path / "checkpoint-4")


def test_saving_where_nothing_can_be_written_names_the_path(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(fz.CheckpointError, match=r"^fz\.save: cannot write the checkpoint directory .*file/ckpt: "
                                                 r"Not a directory \(NotADirectoryError\)"):
        fz.save(fz.init(Net(), fz.Spec()), tmp_path / "file" / "ckpt")


def test_restoring_at_another_world_size_says_what_keeps_the_global_batch(tmp_path):
    import json

    from fz.ckpt.checkpointer import _world_note
    st = fz.init(Net(), fz.Spec(grad_accum=2))
    for saved, says in ((4, r"; saved at world 4, restored at world 1: with the same rows per rank the global batch "
                            r"is 0\.25x what it was \(Spec\(grad_accum=8\) keeps it\)$"),
                        (1, r"^$")):
        (tmp_path / "fz.json").write_text(json.dumps({"world": saved}))
        assert re.search(says, _world_note(tmp_path, st)), _world_note(tmp_path, st)
    # the checkpoint names its rows per rank: a global batch kept by more rows per rank is not changed
    st = fz.init(Net(), fz.Spec(grad_accum=2, micro_batch=8))
    for micro, accum, says in ((4, 2, r"^$"),  # 4 x 2 x 2 ranks = 8 x 2 x 1 rank: the same global batch
                               (4, 4, r"; saved at world 2, restored at world 1: with 8 rows per rank the global "
                                      r"batch is 0\.5x what it was \(Spec\(grad_accum=4\) keeps it\)$")):
        (tmp_path / "fz.json").write_text(json.dumps({"world": 2, "micro_batch": micro, "grad_accum": accum}))
        assert re.search(says, _world_note(tmp_path, st)), _world_note(tmp_path, st)
    for hostile in ('{"world": 0}', '{"world": -3}', '{"world": 1e999}', '{"world": [2]}',  # the note is left out
                    '{"world": 2, "micro_batch": 1' + "0" * 400 + ', "grad_accum": 1}'):  # or says what it can
        (tmp_path / "fz.json").write_text(hostile)
        assert _world_note(tmp_path, st) in ("", "; saved at world 2, restored at world 1: with the same rows per "
                                             "rank the global batch is 0.5x what it was (Spec(grad_accum=4) keeps it)")


def test_weights_of_another_size_lead_with_the_shapes_and_the_configs_sizes(tmp_path):
    """A file of a wider Net: the shape mismatch comes first, before the names that differ; an
    HF folder of a larger config: its config.json's sizes against this model's config."""
    from safetensors.torch import save_file
    wide = {"lin.weight": torch.zeros(2, 8), "lin.bias": torch.zeros(2), "extra.weight": torch.zeros(2)}
    save_file(wide, str(tmp_path / "wide.safetensors"))
    with pytest.raises(fz.CheckpointError, match=r"do not match this model: 1 tensor\(s\) have other shapes than "
                                                 r"this model's \(e\.g\. lin\.weight is \(2, 8\) in the file, \(2, 4\) "
                                                 r"here\): they are of another size of model\. .* The 2 differences: "
                                                 r"shape mismatch: lin\.weight .*; unexpected: extra\.weight$"):
        fz.load_weights(fz.init(Net(), fz.Spec()), tmp_path / "wide.safetensors")

    tr = pytest.importorskip("transformers")

    def llama(hidden: int, layers: int):
        torch.manual_seed(0)
        return tr.LlamaForCausalLM(tr.LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden,
                                                  num_hidden_layers=layers, num_attention_heads=2,
                                                  num_key_value_heads=1, max_position_embeddings=16))
    llama(32, 3).save_pretrained(tmp_path / "big")
    with torch.device("meta"):
        small = llama(16, 2)
    with pytest.raises(fz.CheckpointError) as e:
        fz.init(small, fz.Spec(), weights=tmp_path / "big")
    said = str(e.value)
    assert said.startswith(f"weights {tmp_path / 'big'} do not match this model: they are of another size of model: "
                           f"{tmp_path / 'big' / 'config.json'} has hidden_size=32, intermediate_size=64, "
                           "num_hidden_layers=3, head_dim=16, this model's config hidden_size=16, "
                           "intermediate_size=32, num_hidden_layers=2, head_dim=8. Build the model from that config "
                           f"(transformers: AutoConfig.from_pretrained('{tmp_path / 'big'}'))"), said
    assert re.search(r"\. The \d+ differences: shape mismatch: ", said), said  # the shapes, before the names
