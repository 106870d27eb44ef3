"""A forward hook a library puts on `trainer.model` after fz made the State runs in fz's step too,
and comes off with the settings it reads when train() ends: transformers' NEFTune (the noise
its hook adds to the input embeddings while training), against transformers' own Trainer."""
from __future__ import annotations

from typing import Any

import pytest
import transformers

import fz.hf

from support import hf_pipeline as hp


def _run(on_fz: bool, out: str, alpha: float | None, made_first: bool = True,
         twice: bool = False) -> tuple[list[float], Any]:
    trainer_cls, args_cls = ((fz.hf.Trainer, fz.hf.TrainingArguments) if on_fz else
                             (transformers.Trainer, transformers.TrainingArguments))
    args = args_cls(output_dir=out, per_device_train_batch_size=4, max_steps=4, learning_rate=3e-3, logging_steps=1,
                    use_cpu=True, report_to=[], save_strategy="no", seed=0, disable_tqdm=True,
                    neftune_noise_alpha=alpha)
    t = trainer_cls(model=hp.llama(), args=args, train_dataset=hp.causal_lm_data(), data_collator=hp.collator("lm"))
    if on_fz and made_first:
        t.fz_ready()  # the State made before train() adds the hook, as evaluate() would
    t.train()
    if twice:  # train() again: a new hook, the first one gone (on fz's copy too)
        t.train()
    return [h["loss"] for h in t.state.log_history if "loss" in h], t


def test_neftune_noise_is_transformers_own(tmp_path):
    theirs, _ = _run(False, str(tmp_path / "t"), 5.0)
    ours, trainer = _run(True, str(tmp_path / "f"), 5.0)
    quiet, _ = _run(True, str(tmp_path / "q"), None)
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7)
    assert ours[1:] != pytest.approx(quiet[1:], rel=1e-3)  # the noise reached the step
    embeddings = trainer.model.get_input_embeddings()
    assert not embeddings._forward_hooks  # off the model after train(), as transformers takes it off
    copy = dict(trainer.fz_state.skeleton.root.named_modules())["model.embed_tokens"]
    assert not copy._forward_hooks and "neftune_noise_alpha" not in vars(copy)


def test_neftune_when_the_state_is_made_inside_train_and_train_runs_twice(tmp_path):
    """Made inside train(), fz's copy holds the hook transformers added just before: it comes off
    with the model's at the end, so a second train() adds the noise once, as transformers' does."""
    theirs, _ = _run(False, str(tmp_path / "t"), 5.0, twice=True)
    ours, trainer = _run(True, str(tmp_path / "f"), 5.0, made_first=False, twice=True)
    assert len(ours) == 4 and ours == pytest.approx(theirs, rel=1e-5, abs=1e-7)  # the second run's
    copy = dict(trainer.fz_state.skeleton.root.named_modules())["model.embed_tokens"]
    assert not copy._forward_hooks and "neftune_noise_alpha" not in vars(copy)


class _ScaleEmbeddings(transformers.TrainerCallback):
    """A hook added once training runs (on_train_begin), taken off after step 2 (on_step_end)."""

    def __init__(self):
        self.handle: Any = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.handle = model.get_input_embeddings().register_forward_hook(lambda m, i, out: out * 3.0)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            self.handle.remove()


def test_a_hook_a_callback_adds_once_training_runs_is_in_the_step_and_comes_off(tmp_path):
    """It used to be seen only if present when train() started: fz's step ran without it."""
    losses = {}
    for on_fz in (False, True):
        trainer_cls, args_cls = ((fz.hf.Trainer, fz.hf.TrainingArguments) if on_fz else
                                 (transformers.Trainer, transformers.TrainingArguments))
        args = args_cls(output_dir=str(tmp_path / str(on_fz)), per_device_train_batch_size=4, max_steps=4,
                        learning_rate=3e-3, logging_steps=1, use_cpu=True, report_to=[], save_strategy="no", seed=0,
                        disable_tqdm=True)
        t = trainer_cls(model=hp.llama(), args=args, train_dataset=hp.causal_lm_data(),
                        data_collator=hp.collator("lm"), callbacks=[_ScaleEmbeddings()])
        t.train()
        losses[on_fz] = [h["loss"] for h in t.state.log_history if "loss" in h]
    plain, _ = _run(True, str(tmp_path / "plain"), None)
    assert losses[True] == pytest.approx(losses[False], rel=1e-5, abs=1e-7)
    assert losses[True][0] != pytest.approx(plain[0], rel=1e-3)  # the hook reached the step
