"""`trainer.model` holds no second copy of the trainable weights while fz.hf.Trainer trains
(fz/hf/model_weights.py): transformers places the model on the device, where its own parameters
were a whole stale copy beside the State (at ZeRO-3 more than the rank's share). While train()
runs they are on the meta device, the same parameters (ties and attributes kept); the frozen ones
keep their values; after train() they hold the trained weights, on their device again."""
from __future__ import annotations

import torch
from transformers import TrainerCallback

import fz.hf
from fz.observe.full_params import iter_full_params

from support import hf_pipeline as hp


class Look(TrainerCallback):
    def __init__(self):
        self.seen: list[dict[str, tuple[str, bool]]] = []

    def on_step_end(self, args, state, control, model=None, **kw):
        self.seen.append({n: (p.device.type, p.requires_grad) for n, p in model.named_parameters()})


def test_trainable_weights_are_let_go_while_training_and_filled_in_after(tmp_path):
    model = hp.llama()
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen: kept, it never changes
    frozen = model.model.embed_tokens.weight.detach().clone()
    initial = model.lm_head.weight.detach().clone()
    params = {n: p for n, p in model.named_parameters()}
    model.lm_head.weight.marker = "kept"  # an attribute a library added
    look = Look()
    args = fz.hf.TrainingArguments(str(tmp_path), per_device_train_batch_size=4, max_steps=2, report_to=[],
                                   use_cpu=True, disable_tqdm=True, save_strategy="no", learning_rate=1e-2)
    trainer = fz.hf.Trainer(model=model, args=args, train_dataset=hp.causal_lm_data(), data_collator=hp.collator("lm"),
                            callbacks=[look], spec=fz.Spec(stage=3))
    trainer.train()
    assert len(look.seen) == 2
    for seen in look.seen:
        assert {n for n, (dev, grad) in seen.items() if dev == "meta"} == {n for n, (_, g) in seen.items() if g}
        assert seen["model.embed_tokens.weight"] == ("cpu", False)
    after = dict(trainer.model.named_parameters())
    assert all(after[n] is p and p.device.type == "cpu" for n, p in params.items())
    assert trainer.model.lm_head.weight.marker == "kept"
    assert torch.equal(trainer.model.model.embed_tokens.weight, frozen)
    trained = dict(iter_full_params(trainer.fz_state))
    own = trainer.model.state_dict()
    assert trained and all(torch.equal(own[n], v) for n, v in trained.items() if n in own)
    assert not torch.equal(own["lm_head.weight"], initial)  # trained, not the copy the model was given
