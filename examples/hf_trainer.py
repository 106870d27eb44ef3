"""A Hugging Face Trainer script, as written for DeepSpeed, training on fz: the only change is
the import line (`from fz.hf import Trainer, TrainingArguments`). DeepSpeed need not be
installed; the `--deepspeed` config is read by fz. Nothing is downloaded: the model is a
small GPT-2 built from a config, and the text is the source of a few standard-library modules.

    fz run --num_gpus 2 examples/hf_trainer.py --deepspeed tests/data/ds_config_zero3.json \\
        --output_dir out/hf_trainer --max_steps 50 --per_device_train_batch_size 4 --logging_steps 10
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --deepspeed examples/hf_ds_config.json ...

(On a machine without GPUs add `--use_cpu`.)
"""
from __future__ import annotations

import argparse
import inspect
import json
import textwrap
from dataclasses import dataclass, field

import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser

from fz.hf import Trainer, TrainingArguments  # was: from transformers import Trainer, TrainingArguments


@dataclass
class ModelArguments:
    n_layer: int = field(default=2, metadata={"help": "transformer blocks of the small GPT-2"})
    n_embd: int = field(default=64, metadata={"help": "its width"})
    seq_len: int = field(default=64, metadata={"help": "tokens per sample"})


class Windows(torch.utils.data.Dataset):
    """Windows of `seq` bytes of some standard-library source; labels = inputs (the model shifts them)."""

    def __init__(self, seq: int, part: slice):
        text = "".join(inspect.getsource(m) for m in (argparse, json, textwrap, inspect)).encode()
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.rows = data[: len(data) // seq * seq].view(-1, seq)[part]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def main() -> None:
    model_args, training_args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    config = GPT2Config(vocab_size=256, n_positions=model_args.seq_len, n_embd=model_args.n_embd,
                        n_layer=model_args.n_layer, n_head=4, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(training_args.seed)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    trainer = Trainer(model=model, args=training_args, train_dataset=Windows(model_args.seq_len, slice(0, -32)),
                      eval_dataset=Windows(model_args.seq_len, slice(-32, None)))
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model()  # a folder that GPT2LMHeadModel.from_pretrained(output_dir) loads
    if trainer.is_world_process_zero():
        print(f"eval_loss {metrics['eval_loss']:.4f}; model saved in {training_args.output_dir}")


if __name__ == "__main__":
    main()
