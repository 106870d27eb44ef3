"""fz for Hugging Face users (the `hf` extra): `Trainer` and `TrainingArguments`, drop-in for
transformers' own, training on fz (`from fz.hf import Trainer, TrainingArguments`)."""
from fz.hf.trainer import Trainer
from fz.hf.training_args import TrainingArguments

__all__ = ["Trainer", "TrainingArguments"]
