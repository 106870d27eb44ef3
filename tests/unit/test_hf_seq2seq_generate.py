"""transformers' Seq2SeqTrainer on fz (`fz.hf.on_fz`) with predict_with_generate, at ZeRO-3: HF's
generate calls an encoder-decoder's encoder itself, outside the forward fz stands in for, and
found its weights let go (meta: "Tensor.item() cannot be called on meta tensors" in the
evaluation during training). While train() runs it is fz.generate on the State; the evaluation's
and predict's generated tokens and metrics equal transformers' own run of the same script."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import transformers

import fz
import fz.hf

from support import hf_pipeline as hp


def run(on_fz: bool, out: str) -> dict[str, Any]:
    trainer_cls = fz.hf.on_fz(transformers.Seq2SeqTrainer) if on_fz else transformers.Seq2SeqTrainer
    args_cls = fz.hf.on_fz(transformers.Seq2SeqTrainingArguments) if on_fz else transformers.Seq2SeqTrainingArguments
    args = args_cls(out, per_device_train_batch_size=4, per_device_eval_batch_size=3, max_steps=6, learning_rate=2e-2,
                    eval_strategy="steps", eval_steps=3, predict_with_generate=True, generation_max_length=8,
                    generation_num_beams=2, logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True,
                    save_strategy="no", train_sampling_strategy="sequential",
                    deepspeed=hp.deepspeed(3) if on_fz else None)
    model = hp.t5()
    seen: list[np.ndarray] = []

    def metrics(p: Any) -> dict[str, float]:
        seen.append(np.asarray(p.predictions))
        return {"exact": float(np.mean([np.array_equal(a, b) for a, b in zip(p.predictions, p.label_ids)]))}

    trainer = trainer_cls(model=model, args=args, train_dataset=hp.seq2seq_rows(20, 0),
                          eval_dataset=hp.seq2seq_rows(7, 1),
                          data_collator=transformers.DataCollatorForSeq2Seq(hp.tokenizer(), model=model),
                          compute_metrics=metrics)
    trainer.train()
    assert not on_fz or trainer.fz_state.spec.stage == 3
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    predicted = trainer.predict(hp.seq2seq_rows(5, 2))
    return {"evals": evals, "seen": seen, "predicted": predicted.predictions,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}


def test_generation_in_evaluation_and_predict_is_transformers(tmp_path):
    want, got = run(False, str(tmp_path / "hf")), run(True, str(tmp_path / "fz"))
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
    assert len(got["evals"]) == len(want["evals"]) == 2
    for g, w in zip(got["evals"], want["evals"]):
        assert g["eval_loss"] == pytest.approx(w["eval_loss"], rel=1e-5) and g["eval_exact"] == w["eval_exact"]
    assert len(got["seen"]) == len(want["seen"]) == 3
    assert all(np.array_equal(g, w) for g, w in zip(got["seen"], want["seen"]))
    assert np.array_equal(got["predicted"], want["predicted"])
