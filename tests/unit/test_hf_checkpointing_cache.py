"""gradient_checkpointing=True on a model whose layers write a cache while training (T5's decoder,
use_cache on by default): fz checkpoints whole blocks itself, and Hugging Face's layers inside
them drop their cache arguments as under transformers' own checkpointing. Before, T5's decoder
wrote its cache a second time in fz's recompute and the first backward failed ("A different
number of tensors was saved during the original forward and recomputation"); the losses now
equal transformers' Trainer's run of the same script, at ZeRO-2 and ZeRO-3."""
from __future__ import annotations

from typing import Any

import pytest
import transformers

import fz.hf

from support import hf_pipeline as hp


def run(on_fz: bool, out: str, stage: int) -> tuple[list[float], bool]:
    hf: Any = fz.hf if on_fz else transformers
    model = hp.t5()
    args = hf.TrainingArguments(out, per_device_train_batch_size=4, max_steps=4, learning_rate=2e-2,
                                gradient_checkpointing=True, logging_steps=1, report_to=[], use_cpu=True,
                                disable_tqdm=True, save_strategy="no", train_sampling_strategy="sequential",
                                deepspeed=hp.deepspeed(stage) if on_fz else None)
    trainer = hf.Trainer(model=model, args=args, train_dataset=hp.seq2seq_rows(20, 0),
                         data_collator=transformers.DataCollatorForSeq2Seq(hp.tokenizer(), model=model))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], bool(model.config.use_cache)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_t5_trains_with_checkpointing_as_under_transformers(tmp_path, stage):
    (want, want_cache), (got, cache) = run(False, str(tmp_path / "hf"), stage), run(True, str(tmp_path / "fz"), stage)
    assert got == pytest.approx(want, rel=1e-5)
    assert cache == want_cache  # what transformers' Trainer leaves in the config
