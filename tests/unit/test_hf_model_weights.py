"""`trainer.model` holds no second copy of the weights while fz.hf.Trainer trains
(fz/hf/model_weights.py, fz/hf/model_calls.py): the Trainer does not place the model whole on the
device when it is made (as under DeepSpeed), and while train() runs its parameters, frozen ones
too, are on the meta device, the same parameters (ties and attributes kept); a call of the model
meanwhile runs on the State. After train() they hold the trained weights, on the trainer's device."""
from __future__ import annotations

import functools
import types

import pytest
import torch
from transformers import TrainerCallback

import fz
import fz.hf
from fz.observe.full_params import iter_full_params

from support import hf_pipeline as hp


class Look(TrainerCallback):
    def __init__(self, trainer=None):
        self.seen: list[dict[str, tuple[str, bool]]] = []
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.devices: list[str] = []
        self.trainer = trainer
        self.out: str | None = None

    def on_step_end(self, args, state, control, model=None, **kw):
        self.seen.append({n: (p.device.type, p.requires_grad) for n, p in model.named_parameters()})
        x = torch.tensor([[3, 4, 5, 6]])
        self.calls.append((model(input_ids=x).logits, fz.apply(self.trainer.fz_state, input_ids=x).logits))
        self.devices.append(str(model.device))  # TRL's LogCompletionsCallback: tokenizer(...).to(model.device)
        model.generate(x.to(model.device), max_new_tokens=2, do_sample=False)
        if self.out is not None:  # the model holds no weights to write: a raw meta-tensor error before
            with pytest.raises(fz.ConfigError, match=r"\.save_pretrained\(\) while train\(\) runs at ZeRO-3: .*Call "
                                                     r"trainer\.save_model\(dir\) on every rank"):
                model.save_pretrained(self.out)


def patch_forward(model):
    """As TRL's trainers patch the model they train, after transformers' Trainer is made (its fused
    LM head: a method calling the forward it found, here fz's)."""
    found = model.forward

    @functools.wraps(type(model).forward)  # its signature kept, as TRL keeps it
    def fused(self, *args, fused=False, **kwargs):
        return found(*args, **kwargs)

    model.forward = types.MethodType(fused, model)


@pytest.mark.parametrize("patched", [False, True])
def test_weights_are_let_go_while_training_and_filled_in_after(tmp_path, patched):
    model = hp.llama()
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen: let go too, the same after
    frozen = model.model.embed_tokens.weight.detach().clone()
    initial = model.lm_head.weight.detach().clone()
    params = {n: p for n, p in model.named_parameters()}
    model.lm_head.weight.marker = "kept"  # an attribute a library added
    look = Look()
    look.out = str(tmp_path / "saved_in_a_callback")
    args = fz.hf.TrainingArguments(str(tmp_path), per_device_train_batch_size=4, max_steps=2, report_to=[],
                                   use_cpu=True, disable_tqdm=True, save_strategy="no", learning_rate=1e-2)
    trainer = fz.hf.Trainer(model=model, args=args, train_dataset=hp.causal_lm_data(), data_collator=hp.collator("lm"),
                            callbacks=[look], spec=fz.Spec(stage=3))
    assert trainer.place_model_on_device is False
    if patched:
        patch_forward(trainer.model)
    look.trainer = trainer
    trainer.train()
    assert len(look.seen) == len(look.calls) == 2
    assert look.devices == ["cpu", "cpu"]  # the trainer's, not meta, as DeepSpeed's empty parameters keep theirs
    assert type(trainer.model) is type(hp.llama())  # its own class back after train()
    for seen in look.seen:
        assert {n for n, (dev, _) in seen.items() if dev == "meta"} == set(params)
        assert seen["model.embed_tokens.weight"] == ("meta", False)
    for got, want in look.calls:  # the model called while training: the State's weights of that step
        assert torch.equal(got, want)
    assert not torch.equal(look.calls[0][0], look.calls[1][0])
    after = dict(trainer.model.named_parameters())
    assert all(after[n] is p and p.device.type == "cpu" for n, p in params.items())
    assert trainer.model.lm_head.weight.marker == "kept"
    assert torch.equal(trainer.model.model.embed_tokens.weight, frozen)
    trained = dict(iter_full_params(trainer.fz_state))
    own = trainer.model.state_dict()
    assert trained and all(torch.equal(own[n], v) for n, v in trained.items() if n in own)
    assert not torch.equal(own["lm_head.weight"], initial)  # trained, not the copy the model was given


def test_a_reference_model_trl_prepares_is_not_placed_whole_and_trains_as_an_inference_state(tmp_path, monkeypatch):
    """TRL prepares its reference model with accelerate (`prepare_model(m, evaluation_mode=True)`),
    which puts it whole on the device (under DeepSpeed, ZeRO-3 shards it instead); on fz it stays
    where it is until fz shards it into an inference State."""
    trl = pytest.importorskip("trl")
    import accelerate
    import datasets

    placed = []
    own = accelerate.Accelerator.prepare_model

    def spy(self, model, device_placement=None, evaluation_mode=False):
        placed.append((evaluation_mode, device_placement))
        return own(self, model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    monkeypatch.setattr(accelerate.Accelerator, "prepare_model", spy)
    t = hp.texts(8)
    rows = datasets.Dataset.from_dict({"prompt": [" ".join(x.split()[:2]) for x in t],
                                       "chosen": [" ".join(x.split()[2:]) for x in t],
                                       "rejected": [" ".join(x.split()[3:]) for x in t]})
    args = fz.hf.on_fz(trl.DPOConfig)(str(tmp_path), per_device_train_batch_size=4, max_steps=1, report_to=[],
                                      use_cpu=True, disable_tqdm=True, save_strategy="no", max_length=32)
    ref = hp.llama()
    trainer = fz.hf.on_fz(trl.DPOTrainer)(model=hp.llama(), ref_model=ref, args=args, train_dataset=rows,
                                          processing_class=hp.tokenizer())
    assert (True, False) in placed and (True, None) not in placed and (True, True) not in placed
    trainer.train()
    assert type(trainer.ref_model).__name__ == "OnFzModel" and ref.lm_head.weight.is_meta


class Stop(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 2:
            raise KeyboardInterrupt  # Ctrl-C in a notebook, between steps


def _stopped_trainer(tmp_path):
    args = fz.hf.TrainingArguments(str(tmp_path), per_device_train_batch_size=4, max_steps=4, report_to=[],
                                   use_cpu=True, disable_tqdm=True, save_strategy="no", learning_rate=1e-2)
    return fz.hf.Trainer(model=hp.llama(), args=args, train_dataset=hp.causal_lm_data(),
                         data_collator=hp.collator("lm"), callbacks=[Stop()], spec=fz.Spec(stage=3))


def test_a_train_that_raises_gives_the_model_back_its_weights_as_of_the_failure(tmp_path):
    trainer = _stopped_trainer(tmp_path)
    initial = trainer.model.lm_head.weight.detach().clone()
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert not any(p.is_meta for p in trainer.model.parameters())
    trained = dict(iter_full_params(trainer.fz_state))
    own = trainer.model.state_dict()
    assert trained and all(torch.equal(own[n], v) for n, v in trained.items() if n in own)
    assert not torch.equal(own["lm_head.weight"], initial)
    assert "forward" not in vars(trainer.model)  # a plain module again: no call routed to the State
    trainer.model(input_ids=torch.tensor([[3, 4, 5]]))


def test_weights_that_cannot_come_back_stay_on_meta_and_the_warning_says_where_they_are(tmp_path, monkeypatch,
                                                                                        caplog):
    from fz.hf import model_weights

    def fails(state, model):
        raise fz.ConfigError("a rank is still in its step")

    trainer = _stopped_trainer(tmp_path)
    monkeypatch.setattr(model_weights, "copy_full_params", fails)
    with pytest.raises(KeyboardInterrupt):  # the train() error, not the filling's
        trainer.train()
    assert all(p.is_meta for p in trainer.model.parameters())  # never storage that holds no weights
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "could not be filled back in" in said and "a rank is still in its step" in said, said
    assert "fz.save(trainer.fz_state" in said, said


def test_at_zero_2_the_model_holds_views_of_the_states_weights_while_training(tmp_path):
    """As DeepSpeed's module at ZeRO 0-2 (bf16 there too): the parameters read each update's
    weights in the State's own storage (no second copy), and after train() the model's own, in
    its dtype (the fp32 masters)."""
    class Read(TrainerCallback):
        def __init__(self):
            self.reads = []

        def on_step_end(self, args, state, control, model=None, **kw):
            w = model.lm_head.weight
            states = trainer.fz_state
            ours = [f.to_local() if hasattr(f, "to_local") else f for f in states.param_flats]
            inside = any(f.untyped_storage().data_ptr() == w.untyped_storage().data_ptr() for f in ours)
            self.reads.append((w.dtype, model.device.type, inside, w.detach().clone(),
                               fz.full_params(states, dtype="compute")["lm_head.weight"]))

    read = Read()
    args = fz.hf.TrainingArguments(str(tmp_path), per_device_train_batch_size=4, max_steps=2, report_to=[],
                                   use_cpu=True, disable_tqdm=True, save_strategy="no", learning_rate=1e-2, bf16=True)
    trainer = fz.hf.Trainer(model=hp.llama(), args=args, train_dataset=hp.causal_lm_data(),
                            data_collator=hp.collator("lm"), callbacks=[read], spec=fz.Spec(stage=2, precision="bf16"))
    params = dict(trainer.model.named_parameters())
    trainer.train()
    assert len(read.reads) == 2
    for dtype, device, inside, seen, state_value in read.reads:
        assert (dtype, device, inside) == (torch.bfloat16, "cpu", True)
        assert torch.equal(seen, state_value)
    assert not torch.equal(read.reads[0][3], read.reads[1][3])
    after = dict(trainer.model.named_parameters())
    assert all(after[n] is p and p.dtype == torch.float32 for n, p in params.items())
    masters = fz.full_params(trainer.fz_state)
    assert torch.equal(trainer.model.lm_head.weight, masters["lm_head.weight"])


@pytest.mark.parametrize("stage", [2, 3])
def test_a_weakly_referenced_parameter_does_not_fail_a_finished_train(tmp_path, stage, caplog):
    """A callback keeping a weak reference to a parameter (torch refuses to swap such a tensor):
    train() still ends well; at ZeRO-2 the parameter takes its weights all the same, at ZeRO-3 (on
    meta, which cannot take storage in place) it stays there, named in a warning."""
    import weakref

    class Hold(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            self.ref = weakref.ref(model.lm_head.weight)

    args = fz.hf.TrainingArguments(str(tmp_path), per_device_train_batch_size=4, max_steps=2, report_to=[],
                                   use_cpu=True, disable_tqdm=True, save_strategy="no", learning_rate=1e-2)
    trainer = fz.hf.Trainer(model=hp.llama(), args=args, train_dataset=hp.causal_lm_data(),
                            data_collator=hp.collator("lm"), callbacks=[Hold()], spec=fz.Spec(stage=stage))
    trainer.train()
    full = fz.full_params(trainer.fz_state)
    own = dict(trainer.model.named_parameters())
    assert all(torch.equal(p.detach(), full[n]) for n, p in own.items() if n != "lm_head.weight")
    said = " ".join(r.getMessage() for r in caplog.records)
    if stage == 2:
        assert torch.equal(own["lm_head.weight"].detach(), full["lm_head.weight"]) and "weak" not in said
    else:
        assert own["lm_head.weight"].is_meta and "['lm_head.weight'] cannot hold the trained weights" in said, said


def test_a_deepspeed_bf16_run_casts_the_models_parameters_and_keeps_its_buffers(tmp_path):
    """DeepSpeed 0.19 casts its module's parameters to bf16 and keeps fp32 buffers (RoPE's inv_freq):
    fz cast the whole model, so a no-grad forward of trainer.model after train() (an online trainer's
    policy, RLOO's KL) differed from DeepSpeed's."""
    ds = {"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    args = fz.hf.TrainingArguments(str(tmp_path), per_device_train_batch_size=4, max_steps=1, report_to=[],
                                   use_cpu=True, disable_tqdm=True, save_strategy="no", bf16=True, deepspeed=ds)
    trainer = fz.hf.Trainer(model=hp.llama(), args=args, train_dataset=hp.causal_lm_data(),
                            data_collator=hp.collator("lm"))
    trainer.train()
    buffers = dict(trainer.model.named_buffers())
    assert buffers and all(b.dtype == torch.float32 for b in buffers.values())
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
