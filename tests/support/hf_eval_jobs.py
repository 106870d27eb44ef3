"""fz.hf.Trainer's evaluation, best metric and random draws against transformers' Trainer, both
at world 2 (DDP over gloo for transformers) in the same processes: the rank function of
tests/multirank/test_hf_trainer_eval.py.

- "override": sequence classification with a compute_loss override (class-weighted cross
  entropy), evaluated every 2 steps with compute_metrics, then predict().
- "mlm": BERT's masked LM with its default dropout (0.1) and transformers' unseeded
  DataCollatorForLanguageModeling(mlm=True): masks and dropout both drawn from the process's
  generator, evaluated every 3 steps over 2 epochs with 2 accumulation steps.
- "early": EarlyStoppingCallback on eval_loss (patience 1, greater_is_better: it stops at the
  first fall), save_strategy="best", save_total_limit=1.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from support.hf_pipeline import WORDS, causal_lm_data, deepspeed, llama, texts


def mlm_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4, **{f"w{i}": 5 + i for i in range(WORDS)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM
    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(vocab_size=5 + WORDS, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64))


def classes(on_fz: bool) -> tuple[type, type]:
    import transformers

    import fz.hf
    if on_fz:
        return fz.hf.Trainer, fz.hf.TrainingArguments
    return transformers.Trainer, transformers.TrainingArguments


def weighted(base: type) -> type:
    class Weighted(base):  # type: ignore[misc, valid-type]
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            loss = torch.nn.functional.cross_entropy(outputs["logits"].float(), labels,
                                                     weight=torch.tensor([1.0, 2.0, 0.5]))
            return (loss, outputs) if return_outputs else loss
    return Weighted


def run(out: str, on_fz: bool, case: str, world: int) -> dict[str, Any]:
    import numpy as np
    from transformers import DataCollatorForLanguageModeling, EarlyStoppingCallback

    trainer_cls, args_cls = classes(on_fz)
    settings: dict[str, Any] = dict(
        output_dir=out, per_device_train_batch_size=2, per_device_eval_batch_size=3, learning_rate=5e-3,
        logging_steps=1, use_cpu=True, report_to=[], save_strategy="no", seed=3, disable_tqdm=True,
        eval_strategy="steps", eval_steps=2, num_train_epochs=1)
    if on_fz:
        settings["deepspeed"] = deepspeed(3)
    kw: dict[str, Any] = {}
    if case == "override":
        trainer_cls = weighted(trainer_cls)
        data = causal_lm_data("classes")
        train, evaluated, model = data[:30], data[30:], llama(classes=True)
        kw["compute_metrics"] = lambda p: {"acc": float((p.predictions.argmax(-1) == p.label_ids).mean())}
        from support.hf_pipeline import tokenizer
        kw["processing_class"] = tokenizer()
    elif case == "mlm":
        tk = mlm_tokenizer()
        rows = [dict(tk(t)) for t in texts(40)]
        train, evaluated, model = rows[:29], rows[29:], bert()
        settings.update(gradient_accumulation_steps=2, num_train_epochs=2, eval_steps=3)
        kw["data_collator"] = DataCollatorForLanguageModeling(tk, mlm=True, mlm_probability=0.3)
    else:  # "early"
        from support.hf_pipeline import collator
        data = causal_lm_data()
        train, evaluated, model = data[:36], data[36:], llama()
        settings.update(metric_for_best_model="eval_loss", greater_is_better=True, save_strategy="best",
                        save_total_limit=1, num_train_epochs=3)
        kw.update(data_collator=collator("lm"), callbacks=[EarlyStoppingCallback(early_stopping_patience=1)])
    trainer = trainer_cls(model=model, args=args_cls(**settings), train_dataset=train, eval_dataset=evaluated, **kw)
    result = trainer.train()
    res: dict[str, Any] = {
        "train": [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h],
        "eval": [(h["step"], h["eval_loss"], h.get("eval_acc")) for h in trainer.state.log_history
                 if "eval_loss" in h],
        "train_loss": result.training_loss, "steps": trainer.state.global_step,
        "best": (trainer.state.best_metric, trainer.state.best_global_step,
                 os.path.basename(trainer.state.best_model_checkpoint or "")),
        "saved": sorted(d for d in os.listdir(out) if d.startswith("checkpoint-")) if os.path.isdir(out) else []}
    if case == "override":
        pred = trainer.predict(evaluated)
        res["predict"] = (pred.metrics["test_loss"], pred.metrics["test_acc"], np.asarray(pred.predictions))
    return res


CASES = ("override", "mlm", "early")


def both_runs(rank: int, world: int, out: str) -> dict[str, Any]:
    """Each case on fz.hf.Trainer (ZeRO-3) and on transformers.Trainer, at this world size."""
    return {(case, on_fz): run(os.path.join(out, f"{case}-{'fz' if on_fz else 'ddp'}"), on_fz, case, world)
            for case in CASES for on_fz in (True, False)}
