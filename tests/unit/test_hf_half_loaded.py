"""A model loaded in bf16 (`from_pretrained(..., dtype=torch.bfloat16)`, a LoRA on a bf16 base)
trains on fz.hf.Trainer as under DeepSpeed: fz's fp32 masters are made from its bf16 values (fz
refused it at train() before), the run is the one of the same values loaded in fp32, and after
train() trainer.model holds its trained weights in bf16 again."""
from __future__ import annotations

from typing import Any

import pytest
import torch

import fz.hf

from support import hf_pipeline as hp


def run(out: str, dtype: torch.dtype, stage: int, lora: bool = False) -> tuple[list[float], Any, dict]:
    model = hp.llama().to(torch.bfloat16)
    if lora:
        peft = pytest.importorskip("peft")
        torch.manual_seed(1)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                           init_lora_weights=False))
    model = model.to(dtype)  # the same values either way
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    args = fz.hf.TrainingArguments(out, per_device_train_batch_size=4, max_steps=3, learning_rate=3e-3, bf16=True,
                                   logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True,
                                   save_strategy="no", train_sampling_strategy="sequential",
                                   deepspeed={**hp.deepspeed(stage), "bf16": {"enabled": "auto"}})
    trainer = fz.hf.Trainer(model=model, args=args, train_dataset=hp.causal_lm_data(), data_collator=hp.collator("lm"))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer, dtypes


@pytest.mark.parametrize("stage, lora", [(2, False), (3, False), (3, True)])
def test_a_bf16_model_trains_from_its_values_and_comes_back_in_bf16(tmp_path, caplog, stage, lora):
    want, _, _ = run(str(tmp_path / "fp32"), torch.float32, stage, lora)
    with caplog.at_level("WARNING", logger="fz.hf.model_weights"):
        got, trainer, dtypes = run(str(tmp_path / "bf16"), torch.bfloat16, stage, lora)
    assert "parameters are bfloat16" in caplog.text
    assert got == want
    params = dict(trainer.model.named_parameters())
    assert {n: p.dtype for n, p in params.items()} == dtypes  # each its own again
    assert torch.bfloat16 in dtypes.values()
    for name, value in fz.full_params(trainer.fz_state).items():
        assert torch.equal(params[name].data, value.to(dtypes[name])), name


@pytest.mark.parametrize("under_deepspeed", [True, False])
def test_a_bf16_model_is_saved_in_bf16_as_transformers_saves_it(tmp_path, under_deepspeed):
    """Loaded wholly in bf16, in an fp32 run: save_model and checkpoint-N write bf16 (transformers
    writes the model's own parameters, DeepSpeed its module's, both bf16); fz wrote its fp32 masters."""
    import json

    from safetensors import safe_open
    args = fz.hf.TrainingArguments(str(tmp_path / "run"), per_device_train_batch_size=4, max_steps=2, report_to=[],
                                   use_cpu=True, disable_tqdm=True, save_strategy="steps", save_steps=2,
                                   deepspeed=hp.deepspeed(2) if under_deepspeed else None)
    trainer = fz.hf.Trainer(model=hp.llama().to(torch.bfloat16), args=args, train_dataset=hp.causal_lm_data(),
                            data_collator=hp.collator("lm"))
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    for folder in (tmp_path / "run" / "checkpoint-2", tmp_path / "final"):
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}, folder
        assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
