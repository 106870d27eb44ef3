"""train_sampling_strategy="group_by_length" on fz.hf.Trainer: transformers' LengthGroupedSampler's
grouping, its shuffle seeded by data_seed + epoch (transformers draws it from the process's
generator, which no resume draws again), the draw transformers makes there made all the same so
that later draws (masks, dropout) are transformers'; and a resumed run continues at the exact
next sample."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import transformers

import fz.hf

from support import hf_pipeline as hp


class ReferenceTrainer(transformers.Trainer):
    """transformers' Trainer, its group_by_length shuffle seeded (support/hf_pipeline.py)."""

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        return hp.seeded_groups(super()._get_train_sampler(train_dataset), self.args.seed)


class Lengths:
    """The collator, noting each micro-batch's padded length; masks drawn from torch's generator
    (which a resume within an epoch sets after its first step's collation, as transformers does)."""

    def __init__(self, masks: bool) -> None:
        self.inner, self.padded, self.masks = hp.collator("lm"), [], masks

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.inner(rows)
        self.padded.append(batch["input_ids"].shape[1])
        if self.masks:
            batch["labels"] = batch["labels"].masked_fill(torch.rand(batch["labels"].shape) < 0.3, -100)
        return batch


def run(on_fz: bool, out: str, masks: bool = True, **kw: Any) -> tuple[Any, Lengths]:
    trainer_cls, args_cls = ((fz.hf.Trainer, fz.hf.TrainingArguments) if on_fz else
                             (ReferenceTrainer, transformers.TrainingArguments))
    settings: dict[str, Any] = dict(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=2,
        learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=1, use_cpu=True, report_to=[],
        save_strategy="no", seed=3, disable_tqdm=True, train_sampling_strategy="group_by_length")
    settings.update(kw)
    collate = Lengths(masks)
    t = trainer_cls(model=hp.llama(), args=args_cls(**settings), train_dataset=hp.causal_lm_data(),
                    data_collator=collate, processing_class=hp.tokenizer())
    return t, collate


def losses(t: Any) -> list[float]:
    return [h["loss"] for h in t.state.log_history if "loss" in h]


def test_group_by_length_reads_transformers_groups_and_draws(tmp_path, caplog):
    ref, ref_lengths = run(False, str(tmp_path / "ref"))
    ref.train()
    with caplog.at_level("WARNING", logger="fz.hf.data"):
        t, lengths = run(True, str(tmp_path / "fz"))
        t.train()
    assert lengths.padded == ref_lengths.padded
    assert losses(t) == pytest.approx(losses(ref), rel=1e-5, abs=1e-7)
    assert ref_lengths.padded[0] == max(ref_lengths.padded)  # grouped: the longest first, as transformers
    assert "its shuffle is seeded by data_seed + epoch" in caplog.text


def test_group_by_length_resumes_at_the_exact_next_sample(tmp_path):
    whole, _ = run(True, str(tmp_path / "whole"), masks=False)
    whole.train()
    out = str(tmp_path / "cut")
    first, _ = run(True, out, False, save_strategy="steps", save_steps=5, max_steps=5)
    first.train()
    resumed, _ = run(True, out, False, max_steps=len(losses(whole)))
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-5"))
    assert losses(resumed)[5:] == pytest.approx(losses(whole)[5:], rel=1e-5, abs=1e-7)
    assert len(losses(resumed)) == len(losses(whole))
