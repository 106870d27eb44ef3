"""With `dataloader_num_workers`, a collator's random draws (MLM masks) are transformers': each
micro-batch collated in the generators (torch's, numpy's, random's) of the DataLoader worker
transformers' Trainer hands it to, seeded as its `seed_worker` seeds them, against
transformers.Trainer's own run of the same script (two epochs of 6 steps, its workers forked).
World 2, where the seeds take the rank, is in tests/multirank/test_hf_trainer_pipeline.py."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fz.hf  # noqa: E402
from fz.hf.worker_draws import worker_seed  # noqa: E402

from support import hf_pipeline as hp  # noqa: E402


class StopEpochAt(transformers.TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            control.should_epoch_stop = True


def trainer(on_fz: bool, out: str, callbacks: tuple = (), **kw: Any) -> Any:
    trainer_cls, args_cls = ((fz.hf.Trainer, fz.hf.TrainingArguments) if on_fz else
                             (transformers.Trainer, transformers.TrainingArguments))
    settings: dict[str, Any] = dict(
        output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_train_epochs=2,
        learning_rate=3e-3, logging_steps=1, use_cpu=True, report_to=[], save_strategy="no", seed=3,
        disable_tqdm=True, dataloader_num_workers=2)
    settings.update(kw)
    return trainer_cls(model=hp.llama(), args=args_cls(**settings), train_dataset=hp.causal_lm_data(),
                       data_collator=hp.Masking(), callbacks=list(callbacks))


def losses(t: Any) -> list[float]:
    return [h["loss"] for h in t.state.log_history if "loss" in h]


@pytest.mark.parametrize("persistent", [False, True])
def test_masks_drawn_in_dataloader_workers_are_transformers(tmp_path, persistent):
    """Two epochs: non-persistent workers are seeded anew from each epoch's base draw; persistent
    ones once, their generators going on into the second epoch."""
    got = {}
    for on_fz in (False, True):
        t = trainer(on_fz, str(tmp_path / str(on_fz)), dataloader_persistent_workers=persistent)
        t.train()
        got[on_fz] = losses(t)
    assert len(got[True]) == 12
    assert got[True] == pytest.approx(got[False], rel=1e-5)


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("stop_at", [None, 4])
def test_a_resume_inside_an_epoch_draws_what_transformers_resumed_run_draws(tmp_path, persistent, stop_at):
    """Resumed at step 3 of 6: transformers reads the rest of the epoch through a DataLoader of its
    own (accelerate's skip_first_batches), its workers seeded from a base drawn then, and the next
    epoch through its own DataLoader's first iterator, even when a callback ends the resumed epoch
    early (`stop_at`) and the loop reads again."""
    got = {}
    for on_fz in (False, True):
        out = str(tmp_path / str(on_fz))
        trainer(on_fz, out, save_strategy="steps", save_steps=3, max_steps=3, lr_scheduler_type="constant",
                dataloader_persistent_workers=persistent).train()  # the schedule a resume with other steps keeps
        t = trainer(on_fz, out, (StopEpochAt(stop_at),) if stop_at else (), lr_scheduler_type="constant",
                    dataloader_persistent_workers=persistent)
        t.train(resume_from_checkpoint=os.path.join(out, "checkpoint-3"))
        got[on_fz] = losses(t)
    assert len(got[True]) == (12 if stop_at is None else 10)  # the checkpoint's 3 logged steps, then the rest
    assert got[True] == pytest.approx(got[False], rel=1e-5)


def test_the_worker_seed_is_transformers_seed_worker(monkeypatch):
    """worker_seed is what transformers.trainer_utils.seed_worker sets in worker 1 of 2 on rank 3."""
    from transformers import trainer_utils

    seen = []
    monkeypatch.setattr(trainer_utils, "set_seed", seen.append)
    base = 2**63 - 1
    monkeypatch.setattr(torch, "initial_seed", lambda: base + 1)  # torch seeds worker 1 with base + 1
    trainer_utils.seed_worker(1, num_workers=2, rank=3)
    assert seen == [worker_seed(base, 1, 2, 3)]
