"""fz for Hugging Face users (the `hf` extra): `Trainer` and `TrainingArguments`, drop-in for
transformers' own, training on fz (`from fz.hf import Trainer, TrainingArguments`), and
`save_pretrained`, a live State as a model folder that `from_pretrained` loads; `on_fz(cls)`,
any Trainer subclass (TRL's) or arguments class on fz."""
from fz.hf.export import Exported, save_pretrained
from fz.hf.on_fz import on_fz
from fz.hf.trainer import Trainer
from fz.hf.training_args import TrainingArguments

__all__ = ["Exported", "Trainer", "TrainingArguments", "on_fz", "save_pretrained"]
