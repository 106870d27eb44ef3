"""One Trainer script, run by transformers + DeepSpeed (to make tests/data/hf_deepspeed/) and by
fz.hf resuming from the checkpoint-2 DeepSpeed wrote (tests/multirank/test_hf_ds_resume.py).

Regenerate the fixtures with a python that has DeepSpeed (the CPU is enough):

    DS_ACCELERATOR=cpu PYTHONPATH=.:tests /work/venv-ds/bin/python tests/support/hf_ds_resume.py [NAME ...]

Each fixture: two ranks (gloo) train STEPS steps, saving checkpoint-2, then the same script
resumes from it. Kept: that checkpoint as transformers + DeepSpeed wrote it (DeepSpeed's copies
of its own scripts removed), the steps after it as the resumed run logged them (and as the
uninterrupted one did: transformers sets the saved generators after the first resumed step's
batches are read, so its masks differ there), and the resumed run's final weights
(weights.safetensors).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data" / "hf_deepspeed"
STEPS, SAVED = 4, 2
AUTO = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto"}
ADAMW = {"type": "AdamW", "params": {"lr": "auto", "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}}
DECAY = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                             "warmup_num_steps": "auto", "total_num_steps": "auto"}}
# name: (ZeRO stage, task, DeepSpeed sections): a causal LM over an epoch's end (ZeRO-3, DeepSpeed's
# optimizer and schedule), and BERT's masked LM with dropout (ZeRO-2, the Trainer's AdamW and schedule):
# its masks and dropout come from the generators saved in rng_state_{rank}.pth; and a PEFT LoRA
# run (ZeRO-3), whose checkpoint DeepSpeed saves without the frozen base (exclude_frozen_parameters)
FIXTURES: dict[str, tuple[int, str, dict[str, Any]]] = {
    "z3_lm": (3, "lm", {"optimizer": ADAMW, "scheduler": DECAY}),
    "z2_mlm_dropout": (2, "mlm", {}),
    "z3_lora": (3, "lora", {}),
}


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": 3 + i for i in range(97)}, "<mask>": 100}
    wl = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=wl, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   mask_token="<mask>")


class Rows(torch.utils.data.Dataset):
    """Token rows of 4 to 19 tokens: padded per micro-batch by the collator, uneven across ranks."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(4, 20, (n,), generator=g).tolist()
        self.rows = [torch.randint(3, 100, (n_,), generator=g).tolist() for n_ in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": list(self.rows[i]), "attention_mask": [1] * len(self.rows[i])}


def model(task: str) -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if task == "lora":
        from peft import LoraConfig, get_peft_model

        return get_peft_model(model("lm"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1))
    if task == "mlm":
        return BertForMaskedLM(BertConfig(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                          intermediate_size=64, max_position_embeddings=64, pad_token_id=0))
    return LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, pad_token_id=0,
                                        max_position_embeddings=64))


def trainer(name: str, out: str, trainer_cls: Any, args_cls: Any) -> Any:
    """The script's Trainer: 2 rows x 2 accumulation steps a rank, 20 rows (an epoch is 5 steps at world 2)."""
    from transformers import DataCollatorForLanguageModeling

    stage, task, sections = FIXTURES[name]
    ds = {**AUTO, "zero_optimization": {"stage": stage}, **sections}
    args = args_cls(output_dir=out, deepspeed=ds, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    max_steps=STEPS, learning_rate=1e-2, warmup_steps=1, adam_beta1=0.8, adam_beta2=0.95,
                    adam_epsilon=1e-6, weight_decay=0.1, max_grad_norm=0.5, logging_steps=1, save_strategy="steps",
                    save_steps=SAVED, seed=0, use_cpu=True, report_to=[], disable_tqdm=True)
    collator = DataCollatorForLanguageModeling(tokenizer(), mlm=task == "mlm")
    return trainer_cls(model=model(task), args=args, train_dataset=Rows(20, 1), data_collator=collator)


def losses(t: Any) -> list[dict[str, float]]:
    return [{k: h[k] for k in ("loss", "grad_norm", "learning_rate", "epoch")} for h in t.state.log_history
            if "loss" in h]


def deepspeed_rank(rank: int, world: int, name: str, out: str, resume: str | None = None) -> dict[str, Any]:
    """transformers + DeepSpeed's run, uninterrupted (its checkpoint-2 kept) or resumed from `resume`:
    history and weights."""
    import deepspeed
    from transformers import Trainer, TrainingArguments

    t = trainer(name, out, Trainer, TrainingArguments)
    t.train(resume_from_checkpoint=resume)
    module = t.model_wrapped.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        weights = {k: v.detach().float().clone() for k, v in module.state_dict().items()}
    return {"history": losses(t)[-(STEPS - SAVED):], "weights": weights if rank == 0 else None}


def fz_rank(rank: int, world: int, name: str, checkpoint: str, out: str) -> dict[str, Any]:
    """fz.hf's run of the same script resumed from `checkpoint`: history and weights."""
    from fz.hf import Trainer, TrainingArguments

    t = trainer(name, out, Trainer, TrainingArguments)
    t.train(resume_from_checkpoint=checkpoint)
    weights = {k: v.detach().float().clone() for k, v in t.model.state_dict().items()}
    return {"history": losses(t)[-(STEPS - SAVED):], "weights": weights if rank == 0 else None}


def make(name: str) -> None:
    from safetensors.torch import save_file

    from fz.testing.spawn import run_ranks

    folder = OUT / name
    shutil.rmtree(folder, ignore_errors=True)
    run = folder / "run"
    whole = run_ranks(2, deepspeed_rank, name, str(run), timeout=600)
    checkpoint = folder / f"checkpoint-{SAVED}"
    shutil.move(str(run / checkpoint.name), str(checkpoint))
    shutil.rmtree(run)
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        (checkpoint / script).unlink(missing_ok=True)
    resumed = run_ranks(2, deepspeed_rank, name, str(run), str(checkpoint), timeout=600)
    shutil.rmtree(run)
    save_file({k: v.contiguous() for k, v in resumed[0]["weights"].items()}, str(folder / "weights.safetensors"))
    import deepspeed
    import transformers
    record = {"name": name, "world": 2, "steps": STEPS, "saved": SAVED, "resumed": resumed[0]["history"],
              "uninterrupted": whole[0]["history"], "deepspeed": deepspeed.__version__,
              "transformers": transformers.__version__}
    (folder / "record.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for fixture in sys.argv[1:] or FIXTURES:
        make(fixture)
