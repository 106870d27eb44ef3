"""A user's own optimizer on fz.hf.Trainer: `optimizers=(optimizer, scheduler)` and
`optimizer_cls_and_kwargs=` train as under transformers' Trainer (the same losses, lrs and
weights), and under a DeepSpeed config they are dropped as transformers' deepspeed_init drops
them, with a warning (transformers says nothing)."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

import fz
import fz.hf

from support import hf_pipeline as hp

# transformers 5.24 + DeepSpeed 0.19.8, ZeRO-2, one process, run(..., deepspeed) with optimizers=(SGD, LambdaLR):
# deepspeed_init drops both and trains the arguments' AdamW with their linear schedule
DEEPSPEED_LOSSES = [4.151176452636719, 4.1341681480407715, 4.1798200607299805, 4.1369948387146]
DEEPSPEED_LRS = [0.003, 0.00225, 0.0015, 0.00075]
ZERO2 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
         "gradient_clipping": "auto", "zero_optimization": {"stage": 2}}


def sgd_and_halving(model: torch.nn.Module) -> tuple[Any, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)


def grouped_adamw(model: torch.nn.Module) -> tuple[Any, Any]:
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    rest = [p for n, p in model.named_parameters() if "norm" in n]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=5e-3), None  # transformers' linear schedule over its lr


def run(on_fz: bool, out: str, make: Any = None, deepspeed: Any = None, **kw: Any) -> dict[str, Any]:
    hf: Any = fz.hf if on_fz else transformers
    torch.manual_seed(0)
    model = hp.llama()
    args = hf.TrainingArguments(out, per_device_train_batch_size=4, max_steps=4, learning_rate=3e-3,
                                logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no",
                                train_sampling_strategy="sequential", weight_decay=0.01, deepspeed=deepspeed)
    trainer = hf.Trainer(model=model, args=args, train_dataset=hp.causal_lm_data(), data_collator=hp.collator("lm"),
                         optimizers=make(model) if make else (None, None), **kw)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"losses": [h["loss"] for h in logs], "lrs": [h["learning_rate"] for h in logs],
            "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}}


def same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
    assert got["lrs"] == pytest.approx(want["lrs"], rel=1e-9)
    for k, v in want["weights"].items():
        torch.testing.assert_close(got["weights"][k], v, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", ["sgd_and_halving", "grouped_adamw", "adam_class"])
def test_the_users_optimizer_trains_as_under_transformers(tmp_path, case):
    kw: dict[str, Any] = {"optimizer_cls_and_kwargs": (torch.optim.Adam, {"lr": 4e-3, "betas": (0.8, 0.99)})} \
        if case == "adam_class" else {"make": globals()[case]}
    want = run(False, str(tmp_path / "hf"), **kw)
    got = run(True, str(tmp_path / "fz"), **kw)
    same(got, want)
    assert got["lrs"][0] == {"sgd_and_halving": 0.05, "grouped_adamw": 5e-3, "adam_class": 4e-3}[case]


def test_under_a_deepspeed_config_the_users_optimizer_is_dropped_as_transformers_drops_it(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="fz.hf.client_optimizers"):
        got = run(True, str(tmp_path / "fz"), sgd_and_halving, deepspeed=ZERO2)
    assert "optimizers=(...) is not used under a DeepSpeed config" in caplog.text
    assert got["losses"] == pytest.approx(DEEPSPEED_LOSSES, rel=1e-5)
    assert got["lrs"] == pytest.approx(DEEPSPEED_LRS, rel=1e-9)


def test_what_fz_cannot_honour_is_named_when_the_trainer_is_made(tmp_path):
    model = hp.llama()
    args = fz.hf.TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    opt = torch.optim.Adagrad(model.parameters())
    with pytest.raises(fz.ConfigError, match=r"fz.hf.Trainer\(optimizers=...\): fz reads torch's .* not Adagrad"):
        fz.hf.Trainer(model=model, args=args, train_dataset=hp.causal_lm_data(), optimizers=(opt, None))
    opt = torch.optim.AdamW([{"params": [model.lm_head.weight], "lr": 1e-2},
                             {"params": [p for n, p in model.named_parameters() if n != "lm_head.weight"]}], lr=1e-3)
    with pytest.raises(fz.ConfigError, match=r"its parameter groups have different lr"):
        fz.hf.Trainer(model=model, args=args, train_dataset=hp.causal_lm_data(), optimizers=(opt, None))
    sched = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(model.parameters(), lr=0.1), lambda k: 1.0)
    with pytest.raises(fz.ConfigError, match=r"a scheduler without its optimizer"):
        fz.hf.Trainer(model=model, args=args, train_dataset=hp.causal_lm_data(), optimizers=(None, sched))
