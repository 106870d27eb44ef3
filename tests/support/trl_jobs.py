"""TRL's trainers on fz (issue 41): SFT (text, packed, prompt-completion), DPO (with a reference
model, and a PEFT policy without one), Reward, KTO (unpaired labels, a reference model), each as a
TRL user writes it, on a tiny Llama and data made here. `fz_runs` trains each with
`fz.hf.on_fz(Trainer)` at world 2, ZeRO-3 from a DeepSpeed dict; `reference_runs` with TRL itself
at world 1, the same global batch."""
from __future__ import annotations

import os
from typing import Any

import torch

from support.hf_pipeline import deepspeed, llama, texts, tokenizer

GLOBAL_BATCH = 4


def dataset(kind: str, evaluation: bool = False) -> Any:
    """The training set (40 rows), or 8 others to evaluate on."""
    import datasets
    t, u = (texts(40), texts(40, seed=1)) if not evaluation else (texts(8, seed=2), texts(8, seed=3))
    if kind in ("sft", "sft_packed"):
        return datasets.Dataset.from_dict({"text": t})
    if kind == "sft_completion":
        return datasets.Dataset.from_dict({"prompt": [" ".join(x.split()[:2]) for x in t],
                                           "completion": [" ".join(x.split()[2:]) for x in t]})
    if kind == "reward":
        return datasets.Dataset.from_dict({"chosen": t, "rejected": u})
    if kind == "kto":  # unpaired, two desirable completions in three
        return datasets.Dataset.from_dict({"prompt": [" ".join(x.split()[:2]) for x in t],
                                           "completion": [" ".join(x.split()[2:]) for x in t],
                                           "label": [i % 3 != 0 for i in range(len(t))]})
    return datasets.Dataset.from_dict({"prompt": [" ".join(x.split()[:2]) for x in t],
                                       "chosen": [" ".join(x.split()[2:]) for x in t],
                                       "rejected": [" ".join(x.split()[2:]) for x in u]})


def model(kind: str) -> torch.nn.Module:
    if kind == "reward":
        from transformers import LlamaForSequenceClassification
        cfg = llama().config
        cfg.num_labels = 1
        torch.manual_seed(0)
        return LlamaForSequenceClassification(cfg)
    m = llama()
    if kind == "dpo_peft":
        import peft
        torch.manual_seed(1)
        m = peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                   init_lora_weights=False))
    return m


def classes(kind: str, on_fz: bool) -> tuple[type, type]:
    import trl

    import fz.hf
    trainer, config = {"reward": (trl.RewardTrainer, trl.RewardConfig),
                       "dpo_ref": (trl.DPOTrainer, trl.DPOConfig), "dpo_peft": (trl.DPOTrainer, trl.DPOConfig),
                       "kto": (trl.KTOTrainer, trl.KTOConfig)}.get(kind, (trl.SFTTrainer, trl.SFTConfig))
    return (fz.hf.on_fz(trainer), fz.hf.on_fz(config)) if on_fz else (trainer, config)


def run(out: str, kind: str, on_fz: bool, world: int, **kw: Any) -> tuple[Any, dict[str, Any]]:
    """One TRL run; the trainer and what it logged."""
    trainer_cls, config_cls = classes(kind, on_fz)
    settings: dict[str, Any] = dict(
        output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // world, gradient_accumulation_steps=2,
        num_train_epochs=1, logging_steps=1, report_to=[], use_cpu=True, learning_rate=1e-3, save_strategy="no",
        disable_tqdm=True, max_length=32, bf16=False, seed=0)
    if kind in EVAL_KINDS:
        settings.update(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=GLOBAL_BATCH // world)
    if kind == "sft_packed":
        settings["packing"] = True
    if on_fz:
        settings["deepspeed"] = deepspeed(3)
    settings.update(kw)
    extra = {"ref_model": llama()} if kind in ("dpo_ref", "kto") else {}
    trainer = trainer_cls(model=model(kind), args=config_cls(**settings), train_dataset=dataset(kind),
                          eval_dataset=dataset(kind, evaluation=True) if kind in EVAL_KINDS else None,
                          processing_class=tokenizer(), **extra)
    trainer.train()
    logs = [{k: v for k, v in h.items() if isinstance(v, (int, float))} for h in trainer.state.log_history
            if "loss" in h]
    evals = [{k: v for k, v in h.items() if isinstance(v, (int, float)) and "_per_second" not in k
              and "runtime" not in k} for h in trainer.state.log_history if "eval_loss" in h]
    return trainer, {"logs": logs, "evals": evals, "steps": trainer.state.global_step}


KINDS = ("sft", "sft_packed", "sft_completion", "reward", "dpo_ref", "dpo_peft", "kto")
# evaluated every 2 steps, on fz and on TRL at the same world size (DDP): TRL's SFT evaluation loss
# changes with the world size (TRL's own, at world 1 and 2, differ by 0.3%; fz's equals each)
EVAL_KINDS = ("sft_completion", "reward", "dpo_ref", "dpo_peft", "kto")


def fz_runs(rank: int, world: int, out: str) -> dict[str, Any]:
    import fz
    res: dict[str, Any] = {}
    for kind in KINDS:
        trainer, res[kind] = run(os.path.join(out, kind), kind, True, world)
        if kind in EVAL_KINDS:
            res[f"ddp-{kind}"] = run(os.path.join(out, f"ddp-{kind}"), kind, False, world)[1]
        if kind == "dpo_ref":  # the reference model: an inference-only State, sharded as the policy
            report = fz.memory_report(trainer.ref_model.state)
            res["ref"] = {"class": type(trainer.ref_model).__name__, "stage": trainer.ref_model.state.spec.stage,
                          "params": report.params, "grads": report.grads, "optimizer": report.opt,
                          "numel": sum(p.numel() for p in llama().parameters())}
    res["resume"] = resume(os.path.join(out, "resume"), world)
    trainer, _ = run(os.path.join(out, "saved"), "sft", True, world)
    trainer.save_model(os.path.join(out, "saved", "final"))
    res["saved"] = sorted(os.listdir(os.path.join(out, "saved", "final"))) if rank == 0 else []
    res["saved_weights"] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    return res


def resume(out: str, world: int) -> dict[str, Any]:
    """SFT saving every 2 steps, then a new trainer resumed from checkpoint-2: the last steps again."""
    first, logs = run(out, "sft", True, world, save_strategy="steps", save_steps=2)
    trainer_cls, config_cls = classes("sft", True)
    args = config_cls(output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // world, gradient_accumulation_steps=2,
                      num_train_epochs=1, logging_steps=1, report_to=[], use_cpu=True, learning_rate=1e-3,
                      save_strategy="no", disable_tqdm=True, max_length=32, bf16=False, seed=0, deepspeed=deepspeed(3))
    again = trainer_cls(model=model("sft"), args=args, train_dataset=dataset("sft"), processing_class=tokenizer())
    again.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    mine, theirs = first.model.state_dict(), again.model.state_dict()
    return {"first": [h["loss"] for h in logs["logs"]], "resumed": [h["loss"] for h in again.state.log_history
                                                                     if "loss" in h],
            "same_weights": all(torch.equal(mine[k], theirs[k]) for k in mine)}


def reference_runs(rank: int, world: int, out: str) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for kind in KINDS:
        _, res[kind] = run(os.path.join(out, "ref-" + kind), kind, False, world)
    trainer, _ = run(os.path.join(out, "ref-saved"), "sft", False, world)
    trainer.save_model(os.path.join(out, "ref-saved", "final"))
    res["saved"] = sorted(os.listdir(os.path.join(out, "ref-saved", "final")))
    return res
