"""A bf16 reference model in an fp32 DPO run (TRL's `ref_model=` loaded in bf16): fz refused it at
train() (fz.init keeps fp32 values); it now holds it as an inference State of its bf16 values that
computes in bf16, as TRL runs it (and DeepSpeed, whose losses and rewards it equalled only to 1e-2
while fz computed it in fp32). The logged losses and rewards equal TRL's own run."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from support.hf_pipeline import llama, tokenizer
from support.trl_jobs import classes, dataset

trl = pytest.importorskip("trl")


def run(out: str, on_fz: bool) -> list[dict[str, Any]]:
    trainer_cls, config_cls = classes("dpo_ref", on_fz)
    args = config_cls(output_dir=out, per_device_train_batch_size=4, max_steps=3, logging_steps=1, report_to=[],
                      use_cpu=True, learning_rate=1e-3, save_strategy="no", disable_tqdm=True, max_length=32,
                      bf16=False, seed=0)
    trainer = trainer_cls(model=llama(), ref_model=llama().to(torch.bfloat16), args=args,
                          train_dataset=dataset("dpo_ref"), processing_class=tokenizer())
    trainer.train()
    if on_fz:
        assert trainer.ref_model.state.spec.precision == "bf16"
    return [h for h in trainer.state.log_history if "loss" in h]


def test_a_bf16_reference_model_computes_as_trl_runs_it(tmp_path):
    want, got = run(str(tmp_path / "trl"), False), run(str(tmp_path / "fz"), True)
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        for key in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen"):
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-7), key
