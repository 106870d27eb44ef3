"""load_best_model_at_end (it was refused): after train() the model holds the best checkpoint's
weights, as transformers' own Trainer gives them; the State is that checkpoint's, as DeepSpeed's
engine loads it whole (transformers' deepspeed_load_checkpoint)."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

import fz.hf

from support import hf_pipeline as hp


def _trained(out: str, on_fz: bool, **kw: Any) -> Any:
    trainer_cls, args_cls = ((fz.hf.Trainer, fz.hf.TrainingArguments) if on_fz else
                             (transformers.Trainer, transformers.TrainingArguments))
    args = args_cls(output_dir=out, per_device_train_batch_size=4, max_steps=6, learning_rate=3e-3, use_cpu=True,
                    report_to=[], seed=0, disable_tqdm=True, eval_strategy="steps", eval_steps=2, save_steps=2,
                    load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True, **kw)
    data = hp.causal_lm_data()
    trainer = trainer_cls(model=hp.llama(), args=args, train_dataset=data, eval_dataset=data[:8],
                          data_collator=hp.collator("lm"))
    trainer.train()
    return trainer


@pytest.mark.parametrize("limit", [None, 1])
def test_the_model_holds_the_best_checkpoints_weights_as_in_transformers(tmp_path, limit):
    theirs = _trained(str(tmp_path / "t"), False, save_total_limit=limit)
    ours = _trained(str(tmp_path / "f"), True, save_total_limit=limit)
    # eval_loss falls: with greater_is_better=True the best is the first checkpoint, not the last
    assert ours.state.best_model_checkpoint.endswith("checkpoint-2") and ours.state.global_step == 6
    assert theirs.state.best_model_checkpoint.endswith("checkpoint-2")
    want, got = theirs.model.state_dict(), ours.model.state_dict()
    assert all(torch.allclose(got[k], want[k], rtol=1e-4, atol=1e-6) for k in want)
    assert int(ours.fz_state.step) == 2  # the State is the best checkpoint's whole, as DeepSpeed's engine loads it
    kept = sorted(p.name for p in (tmp_path / "f").iterdir() if p.name.startswith("checkpoint-"))
    assert kept == (["checkpoint-2"] if limit == 1 else ["checkpoint-2", "checkpoint-4", "checkpoint-6"])
