"""Resuming with a larger max_steps (train to 4, then resume_from_checkpoint with max_steps=8):
fz trains on with the new run's schedule from the next step, where transformers' Trainer and
DeepSpeed train that one step with the lr the old schedule left in the optimizer (0 for a linear
decay that had ended). fz says so when it resumes, never silently."""
from __future__ import annotations

import os
from typing import Any

import pytest

import fz.hf

from support import hf_pipeline as hp


def trainer(out: str, **kw: Any) -> fz.hf.Trainer:
    args = fz.hf.TrainingArguments(out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                   learning_rate=3e-3, warmup_steps=1, lr_scheduler_type="linear", logging_steps=1,
                                   use_cpu=True, report_to=[], disable_tqdm=True, train_sampling_strategy="sequential",
                                   **{"save_strategy": "no", **kw})
    return fz.hf.Trainer(model=hp.llama(), args=args, train_dataset=hp.causal_lm_data(),
                         data_collator=hp.collator("lm"))


def test_a_resume_under_another_schedule_says_which_lr_it_trains_with(tmp_path, caplog):
    out = str(tmp_path / "run")
    trainer(out, save_strategy="steps", save_steps=4, max_steps=4).train()
    resumed = trainer(out, max_steps=8)
    with caplog.at_level("WARNING", logger="fz.hf.trainer_checkpoints"):
        resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-4"))
    assert "resuming a run of max_steps=4 with max_steps=8" in caplog.text
    step5 = next(h for h in resumed.state.log_history if h.get("step") == 5 and "loss" in h)
    assert step5["learning_rate"] == pytest.approx(3e-3 * (8 - 4) / (8 - 1))  # linear, 1 warmup step, of this run
