"""A forward hook a library puts on `trainer.model` after fz made the State runs in fz's step too,
and comes off with the settings it reads when train() ends: transformers' NEFTune (the noise
its hook adds to the input embeddings while training), against transformers' own Trainer."""
from __future__ import annotations

from typing import Any

import pytest
import transformers

import fz.hf

from support import hf_pipeline as hp


def _run(on_fz: bool, out: str, alpha: float | None) -> tuple[list[float], Any]:
    trainer_cls, args_cls = ((fz.hf.Trainer, fz.hf.TrainingArguments) if on_fz else
                             (transformers.Trainer, transformers.TrainingArguments))
    args = args_cls(output_dir=out, per_device_train_batch_size=4, max_steps=4, learning_rate=3e-3, logging_steps=1,
                    use_cpu=True, report_to=[], save_strategy="no", seed=0, disable_tqdm=True,
                    neftune_noise_alpha=alpha)
    t = trainer_cls(model=hp.llama(), args=args, train_dataset=hp.causal_lm_data(), data_collator=hp.collator("lm"))
    t.fz_ready() if on_fz else None  # the State made before train() adds the hook, as evaluate() would
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
