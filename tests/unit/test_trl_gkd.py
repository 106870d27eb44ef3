"""TRL's GKD (trl.experimental.gkd) on fz against TRL's own run of the same script (one process):
its training_step draws `random.random()` each micro-batch and, below `lmbda`, the student
generates the completions it trains on (sampling, from the process's generator); with `seq_kd`
the teacher generates them. fz runs that training_step as written for each micro-batch's inputs
(fz/hf/step_inputs.py): the same draws, the same completions, the same losses and weights."""
from __future__ import annotations

import random
from typing import Any

import pytest
import torch

trl = pytest.importorskip("trl")
gkd = pytest.importorskip("trl.experimental.gkd")
datasets = pytest.importorskip("datasets")

import fz.hf  # noqa: E402

from support import hf_pipeline as hp  # noqa: E402


def chats(n: int = 16) -> Any:
    turns = [(" ".join(t.split()[:2]), " ".join(t.split()[2:])) for t in hp.texts(n)]
    return datasets.Dataset.from_dict({"messages": [
        [{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in turns]})


def tokenizer() -> Any:
    tk = hp.tokenizer()
    tk.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% endfor %}"
                        "{% if add_generation_prompt %}assistant: {% endif %}")
    return tk


def run(on_fz: bool, out: str, **kw: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    trainer_cls, config_cls = gkd.GKDTrainer, gkd.GKDConfig
    settings: dict[str, Any] = dict(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                    max_steps=3, logging_steps=1, report_to=[], use_cpu=True, learning_rate=3e-2,
                                    save_strategy="no", disable_tqdm=True, bf16=False, seed=0, max_new_tokens=6,
                                    temperature=0.9, beta=0.5)
    if on_fz:
        trainer_cls, config_cls = fz.hf.on_fz(trainer_cls), fz.hf.on_fz(config_cls)
        settings["deepspeed"] = hp.deepspeed(2)
    settings.update(kw)
    teacher = hp.llama()
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for p in teacher.parameters():
            p.add_(torch.randn(p.shape, generator=g), alpha=0.05)
    random.seed(0)  # the draw below lmbda is random.random()'s
    trainer = trainer_cls(model=hp.llama(), teacher_model=teacher, args=config_cls(**settings),
                          train_dataset=chats(), processing_class=tokenizer())
    trainer.train()
    logs = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return logs, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("stage, settings", [(2, {"lmbda": 0.5}), (3, {"lmbda": 0.5}), (2, {"lmbda": 0.0})],
                         ids=["student-generates-z2", "student-generates-z3", "off-policy-z2"])
def test_gkd_trains_as_trl_trains_it(tmp_path, stage, settings):
    ref_losses, ref_weights = run(False, str(tmp_path / "trl"), **settings)
    losses, weights = run(True, str(tmp_path / "fz"), deepspeed=hp.deepspeed(stage), **settings)
    assert len(losses) == 3
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for k, v in ref_weights.items():
        assert torch.allclose(weights[k], v, rtol=1e-4, atol=1e-6), k


def test_the_teacher_generating_is_refused_when_the_trainer_is_made(tmp_path):
    with pytest.raises(fz.ConfigError, match="seq_kd=True: the teacher generates the completions"):
        run(True, str(tmp_path / "fz"), lmbda=0.0, seq_kd=True)


def test_training_step_called_outside_fz_s_loop_is_an_error(tmp_path):
    t = fz.hf.Trainer(model=hp.llama(), args=fz.hf.TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                                                      report_to=[]))
    with pytest.raises(fz.ConfigError, match="fz.train_step runs each update; fz's loop calls training_step only"):
        t.training_step(t.model, {"input_ids": torch.ones(1, 3, dtype=torch.long)})
