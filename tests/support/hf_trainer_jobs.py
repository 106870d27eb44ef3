"""Rank functions for tests/multirank/test_hf_trainer.py: a seed-002 style Trainer script on a
tiny GPT-2 (built from a config, no download) and a token data set made here."""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

SEQ, VOCAB = 16, 100
ZERO3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
         "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto"}


class Tokens(torch.utils.data.Dataset):
    """`n` rows of random token ids; labels = inputs (the model shifts them)."""

    def __init__(self, n: int = 64, seed: int = 0):
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"
    return model


def accuracy(pred: Any) -> dict[str, float]:
    """compute_metrics: next-token accuracy of the argmax."""
    logits, labels = pred.predictions, pred.label_ids
    return {"accuracy": float((np.argmax(logits[:, :-1], -1) == labels[:, 1:]).mean())}


def arguments(out: str, fz_args: bool, **kw: Any) -> Any:
    import transformers

    import fz.hf
    cls = fz.hf.TrainingArguments if fz_args else transformers.TrainingArguments
    settings = dict(output_dir=out, per_device_train_batch_size=4, max_steps=6, logging_steps=1, learning_rate=1e-3,
                    warmup_steps=2, use_cpu=True, report_to=[], train_sampling_strategy="sequential", seed=0,
                    disable_tqdm=True, save_strategy="no", per_device_eval_batch_size=4)
    settings.update(kw)
    return cls(**settings)


def losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def train_save_resume(rank: int, world: int, out: str) -> dict[str, Any]:
    """fz.hf.Trainer at ZeRO-3 from a DeepSpeed dict: 6 steps saving every 3, evaluate, predict;
    then a new Trainer resumed from checkpoint-3."""
    import fz.hf
    args = arguments(out, True, deepspeed=ZERO3, save_strategy="steps", save_steps=3, eval_strategy="steps",
                     eval_steps=3)
    seen: list[dict[str, Any]] = []

    sampled: list[list[int]] = []
    prompt, new_tokens = torch.tensor([[3, 4, 5, 6]]), 2 + 3 * rank  # one rank's sequence ends first

    class Record(__import__("transformers").TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            seen.append(dict(logs or {}))

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if state.global_step == state.max_steps:  # the trained weights, still the State's (ZeRO-3)
                sampled.extend(model.generate(prompt, max_new_tokens=new_tokens, do_sample=False).tolist())

    trainer = fz.hf.Trainer(model=gpt2(), args=args, train_dataset=Tokens(), eval_dataset=Tokens(16, seed=1),
                            compute_metrics=accuracy, callbacks=[Record()])
    result = trainer.train()
    whole = trainer.model.generate(prompt, max_new_tokens=new_tokens, do_sample=False).tolist()
    metrics = trainer.evaluate()
    pred = trainer.predict(Tokens(8, seed=2))
    trainer.save_model(os.path.join(out, "final"))  # every rank; the folder from_pretrained loads
    sd = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    full = fz_full(trainer)
    resumed = fz.hf.Trainer(model=gpt2(), args=arguments(out, True, deepspeed=ZERO3), train_dataset=Tokens())
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-3"))
    seed = seed_002(out + "-seed002")
    bema = bema_weights(True, out + "-bema", deepspeed={**ZERO3, "zero_optimization": {"stage": 2}})
    listing = sorted(os.listdir(out)) if rank == 0 else []
    ckpt3 = sorted(os.listdir(os.path.join(out, "checkpoint-3"))) if rank == 0 else []
    state_json = json.load(open(os.path.join(out, "checkpoint-3", "trainer_state.json"))) if rank == 0 else {}
    return {"losses": losses(trainer), "resumed": losses(resumed), "train_loss": result.training_loss,
            "metrics": metrics, "pred_shape": tuple(pred.predictions.shape), "pred_metrics": pred.metrics,
            "logs": seen, "listing": listing, "ckpt3": ckpt3, "state_json_step": state_json.get("global_step"),
            "model_matches_state": all(torch.equal(sd[k], full[k]) for k in full if k in sd),
            "world": (args.world_size, args.process_index), "seed_002": seed, "bema": bema,
            "sampled": (sampled, whole)}


def bema_weights(on_fz: bool, out: str, **kw: Any) -> dict[str, torch.Tensor] | None:
    """TRL's BEMACallback (an average of the weights it reads from `trainer.model` after every
    update) over 6 steps: its averaged weights (None without TRL)."""
    try:
        from trl import BEMACallback
    except ImportError:
        return None
    import transformers

    import fz.hf
    bema = BEMACallback(update_freq=1)
    cls = fz.hf.Trainer if on_fz else transformers.Trainer
    cls(model=gpt2(), args=arguments(out, on_fz, **kw), train_dataset=Tokens(), callbacks=[bema]).train()
    return {k: v.clone() for k, v in bema.running_model.state_dict().items()}


SEED_002 = dict(per_device_train_batch_size=2, gradient_checkpointing=True, optim="adafactor", logging_steps=1,
                learning_rate=1e-3)  # seed 002's TrainingArguments, on a scale that runs here


def seed_002(out: str) -> list[float]:
    """Seed 002's Trainer snippet with `from fz.hf import Trainer`: ZeRO-3 from a DeepSpeed file,
    adafactor, gradient checkpointing, 2 accumulation steps (global batch 8 at world 2)."""
    import fz.hf
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "zero_train.json")
    with open(path, "w") as f:
        json.dump(ZERO3, f)
    args = arguments(out, True, deepspeed=path, gradient_accumulation_steps=2, **SEED_002)
    trainer = fz.hf.Trainer(model=gpt2(), args=args, train_dataset=Tokens())
    trainer.train()
    assert trainer.fz_state is not None and trainer.fz_state.spec.activation_checkpointing
    return losses(trainer)


def fz_full(trainer: Any) -> dict[str, torch.Tensor]:
    import fz
    return fz.full_params(trainer.fz_state)


def reference_and_resume(rank: int, world: int, out: str) -> dict[str, Any]:
    """World 1: transformers' own Trainer on the same global batch (4 x 2 accumulation), its
    evaluation, and fz.hf.Trainer resumed at world 1 from the world-2 run's checkpoint-3."""
    import transformers

    import fz.hf
    ref = transformers.Trainer(model=gpt2(), args=arguments(out + "-ref", False, gradient_accumulation_steps=2),
                               train_dataset=Tokens(), eval_dataset=Tokens(16, seed=1), compute_metrics=accuracy)
    untrained = transformers.Trainer(model=gpt2(), args=arguments(out + "-ref0", False),
                                     eval_dataset=Tokens(16, seed=1)).evaluate()["eval_loss"]
    untrained_fz = fz.hf.Trainer(model=gpt2(), args=arguments(out + "-fz0", True),
                                 eval_dataset=Tokens(16, seed=1)).evaluate()["eval_loss"]
    ref.train()
    metrics = ref.evaluate()
    resumed = fz.hf.Trainer(model=gpt2(), args=arguments(out, True, deepspeed=ZERO3, gradient_accumulation_steps=2),
                            train_dataset=Tokens())
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-3"))
    lrs = [h["learning_rate"] for h in ref.state.log_history if "loss" in h]
    seed_args = arguments(out + "-seed002-ref", False, gradient_accumulation_steps=4, **SEED_002)
    seed_ref = transformers.Trainer(model=gpt2(), args=seed_args, train_dataset=Tokens())
    seed_ref.train()
    rotated = fz.hf.Trainer(model=gpt2(), args=arguments(out + "-rot", True, save_strategy="steps", save_steps=2,
                                                         save_total_limit=2, report_to=["tensorboard"]),
                            train_dataset=Tokens())
    rotated.train()
    kept = sorted(os.listdir(out + "-rot"))
    longer = fz.hf.Trainer(model=gpt2(), args=arguments(out + "-rot", True, max_steps=8), train_dataset=Tokens())
    longer.train(resume_from_checkpoint=True)
    steps = [h["step"] for h in longer.state.log_history if "loss" in h]
    bema = bema_weights(False, out + "-bema-ref", gradient_accumulation_steps=2)
    events = [f for _, _, fs in os.walk(out + "-rot") for f in fs if f.startswith("events.out.tfevents")]
    return {"losses": losses(ref), "lrs": lrs, "metrics": metrics, "resumed": losses(resumed), "kept": kept,
            "resumed_steps": steps, "tensorboard_files": len(events), "seed_002": losses(seed_ref),
            "eval_only": (untrained, untrained_fz), "bema": bema}
