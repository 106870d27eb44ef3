"""lr_scheduler_type="reduce_lr_on_plateau" on fz.hf.Trainer (refused before): torch's
ReduceLROnPlateau stepped by transformers' own _evaluate with the evaluation's loss, the updates
after it on the lr it left: the lrs and losses equal transformers' Trainer's run of the same
script, and a run resumed from a checkpoint goes on with the plateau's saved lr and patience."""
from __future__ import annotations

import os
from typing import Any

import pytest
import transformers

import fz.hf

from support import hf_pipeline as hp


def run(on_fz: bool, out: str, resume: str | None = None, **kw: Any) -> list[tuple[float, float]]:
    hf: Any = fz.hf if on_fz else transformers
    settings: dict[str, Any] = dict(
        per_device_train_batch_size=4, max_steps=12, learning_rate=5e-2, lr_scheduler_type="reduce_lr_on_plateau",
        lr_scheduler_kwargs={"factor": 0.5, "patience": 0, "threshold": 0.5}, eval_strategy="steps", eval_steps=2,
        logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no",
        train_sampling_strategy="sequential")
    settings.update(kw)
    trainer = hf.Trainer(model=hp.llama(), args=hf.TrainingArguments(out, **settings),
                         train_dataset=hp.causal_lm_data(), eval_dataset=hp.causal_lm_data()[:8],
                         data_collator=hp.collator("lm"))
    trainer.train(resume_from_checkpoint=resume)
    return [(h["loss"], h["learning_rate"]) for h in trainer.state.log_history if "loss" in h]


def test_the_plateau_steps_on_the_evaluation_as_in_transformers(tmp_path):
    want, got = run(False, str(tmp_path / "hf")), run(True, str(tmp_path / "fz"))
    assert len({lr for _, lr in want}) > 2  # it did reduce the lr, more than once
    assert [lr for _, lr in got] == pytest.approx([lr for _, lr in want], rel=1e-9)
    assert [loss for loss, _ in got] == pytest.approx([loss for loss, _ in want], rel=1e-5)


def test_a_resumed_run_goes_on_with_the_plateaus_state(tmp_path):
    whole = run(True, str(tmp_path / "whole"))
    out = str(tmp_path / "cut")
    run(True, out, save_strategy="steps", save_steps=6)
    resumed = run(True, out, resume=os.path.join(out, "checkpoint-6"))
    assert len(resumed) == len(whole) == 12
    assert [x for pair in resumed[6:] for x in pair] == pytest.approx([x for pair in whole[6:] for x in pair], rel=1e-6)
