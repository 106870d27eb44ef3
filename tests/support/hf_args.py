"""What tests/unit/test_hf_arguments.py and test_hf_arguments_optim.py share: a tiny model named
like a transformers one, TrainingArguments built without deepspeed installed, and a call that
turns DeepSpeedConfigWarning into an error. Imported after `pytest.importorskip("transformers")`."""
from __future__ import annotations

import warnings

import torch
import transformers

from fz.config import DeepSpeedConfigWarning

STEPS = 20


class Tiny(torch.nn.Module):
    """Named like a transformers model: a LayerNorm, biases, and a config with hidden_size."""

    def __init__(self, hidden=8):
        super().__init__()
        self.config = transformers.PretrainedConfig(hidden_size=hidden)
        self.lin = torch.nn.Linear(hidden, hidden)
        self.ln_f = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, 3, bias=False)


def make_args(tmp_path, **kw):
    deepspeed = kw.pop("deepspeed", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)
    args.deepspeed = deepspeed  # TrainingArguments(deepspeed=...) needs deepspeed installed
    return args


def quiet(fn, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeepSpeedConfigWarning)
        return fn(*a, **kw)
