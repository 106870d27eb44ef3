"""label_smoothing_factor on fz.hf.Trainer: transformers' compute_loss smooths the labels, and
shifts them for a causal LM, which it tells by the unwrapped model's class name (a PEFT model's
base model's). fz's step and evaluation run that compute_loss: the losses and the evaluation loss
equal transformers' Trainer's run of the same script (a LoRA model's too)."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

import fz.hf

from support import hf_pipeline as hp


def run(on_fz: bool, out: str, lora: bool) -> tuple[list[float], float]:
    hf: Any = fz.hf if on_fz else transformers
    torch.manual_seed(0)
    model = hp.llama()
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                           init_lora_weights=False))
    args = hf.TrainingArguments(out, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4,
                                learning_rate=3e-3, label_smoothing_factor=0.1, logging_steps=1, report_to=[],
                                use_cpu=True, disable_tqdm=True, save_strategy="no",
                                train_sampling_strategy="sequential")
    trainer = hf.Trainer(model=model, args=args, train_dataset=hp.causal_lm_data(), data_collator=hp.collator("lm"),
                         eval_dataset=hp.causal_lm_data()[:9])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, trainer.evaluate()["eval_loss"]


@pytest.mark.parametrize("lora", [False, True])
def test_label_smoothing_is_transformers(tmp_path, lora):
    want, got = run(False, str(tmp_path / "hf"), lora), run(True, str(tmp_path / "fz"), lora)
    assert got[0] == pytest.approx(want[0], rel=1e-5)
    assert got[1] == pytest.approx(want[1], rel=1e-5)
