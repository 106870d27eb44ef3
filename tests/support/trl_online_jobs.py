"""TRL's online trainers (GRPO, RLOO, Distillation) as a TRL user writes them, on fz and on TRL itself:
a tiny Llama saved as a folder (TRL makes the reference model from it, as from a Hub name; the
distillation teacher is another), prompts made here and a reward that counts words. Sampling draws
from each process's generator, so a run on fz and TRL's own run of the same script generate the same
completions only where the weights, the data order and every draw before agree: the logged rewards,
completion lengths, losses, gradient norms and KL follow the whole loop."""
from __future__ import annotations

import os
from typing import Any

from support.hf_pipeline import deepspeed, llama, texts, tokenizer

GLOBAL_BATCH = 8  # completions per micro-step, all ranks
KINDS: dict[str, dict[str, Any]] = {
    # a reference model (KL), the same generations trained on twice (the old policy's log-probabilities)
    "grpo": dict(trainer="GRPO", beta=0.05, num_iterations=2),
    # one generation for two updates: the weights are those of the update that generated
    "grpo_spg": dict(trainer="GRPO", steps_per_generation=4, loss_type="grpo"),
    "rloo": dict(trainer="RLOO", beta=0.05),
    # a LoRA policy (peft_config=): the reference is the policy with its adapter disabled
    "grpo_peft": dict(trainer="GRPO", beta=0.05),
    # a streamed dataset (TRL repeats its rows with IterableDataset.map), evaluated every 2 steps (generating)
    "grpo_stream": dict(trainer="GRPO", beta=0.05, eval_strategy="steps", eval_steps=2),
    # on-policy distillation from a teacher (its backbone and LM head read through TRL's forward
    # redirection), evaluated every 2 steps (generating)
    "distill": dict(trainer="Distillation", eval_strategy="steps", eval_steps=2),
    # a LoRA student (TRL reads its backbone as a PEFT model's: fz's step model passes for one)
    "distill_peft": dict(trainer="Distillation", eval_strategy="steps", eval_steps=2),
}
LOGGED = ("loss", "grad_norm", "learning_rate", "reward", "reward_std", "entropy", "kl", "completions/mean_length",
          "completions/clipped_ratio", "num_tokens", "epoch")


def policy_folder(out: str) -> str:
    """The policy, saved as from_pretrained reads it (on rank 0 only; the others wait for it)."""
    path = os.path.join(out, "policy")
    if not os.path.exists(os.path.join(path, "config.json")):
        m = llama()
        m.config.eos_token_id = 1
        m.save_pretrained(path + ".tmp")
        os.replace(path + ".tmp", path) if not os.path.exists(path) else None
    return path


def teacher_folder(out: str) -> str:
    """The distillation teacher: the policy's shape, other weights."""
    import torch
    path = os.path.join(out, "teacher")
    if not os.path.exists(os.path.join(path, "config.json")):
        m = llama()
        m.config.eos_token_id = 1
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g), alpha=0.05)
        m.save_pretrained(path + ".tmp")
        os.replace(path + ".tmp", path) if not os.path.exists(path) else None
    return path


def prompts(n: int = 16) -> Any:
    import datasets
    return datasets.Dataset.from_dict({"prompt": [" ".join(t.split()[:2 + i % 3]) for i, t in enumerate(texts(n))]})


def words(completions: list[str], **kw: Any) -> list[float]:
    """A reward a tiny model can learn: completions of more words score higher."""
    return [len(c.split()) / 8 for c in completions]


def run(out: str, kind: str, on_fz: bool, world: int, model: str, **kw: Any) -> tuple[Any, dict[str, Any]]:
    import trl

    import fz.hf
    settings = dict(KINDS[kind])
    name = settings.pop("trainer")
    trainer_cls, config_cls = getattr(trl, f"{name}Trainer"), getattr(trl, f"{name}Config")
    if on_fz:
        trainer_cls, config_cls = fz.hf.on_fz(trainer_cls), fz.hf.on_fz(config_cls)
        settings["deepspeed"] = deepspeed(3)
    distill = name == "Distillation"
    settings.update(output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // world, gradient_accumulation_steps=2,
                    max_completion_length=8, max_steps=4, logging_steps=1, report_to=[],
                    use_cpu=True, learning_rate=3e-2, save_strategy="no", disable_tqdm=True, bf16=False, seed=0)
    if not distill:
        settings["num_generations"] = 4
    settings.update(kw)
    stream, evaluated = kind == "grpo_stream", "eval_strategy" in settings
    if evaluated:
        settings["per_device_eval_batch_size"] = GLOBAL_BATCH // world
    given = {"teacher_model": teacher_folder(os.path.dirname(out))} if distill else {"reward_funcs": words}
    trainer = trainer_cls(model=model, args=config_cls(**settings), **given,
                          train_dataset=prompts().to_iterable_dataset() if stream else prompts(),
                          eval_dataset=prompts(8) if evaluated else None, processing_class=tokenizer(),
                          **({"peft_config": _lora()} if kind.endswith("_peft") else {}))
    trainer.train()
    logs = [{k: float(h[k]) for k in LOGGED if k in h} for h in trainer.state.log_history if "loss" in h]
    evals = [{k: float(h[k]) for k in ("eval_loss", "eval_reward", "eval_kl", "eval_completions/mean_length")
              if k in h} for h in trainer.state.log_history if "eval_loss" in h]
    return trainer, {"logs": logs, "evals": evals, "steps": trainer.state.global_step}


def _lora() -> Any:
    import peft
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def jobs(rank: int, world: int, out: str) -> dict[str, Any]:
    """Each kind on fz (ZeRO-3 from a DeepSpeed dict) and on TRL itself (DDP), in these processes;
    and a GRPO run resumed from its step-2 checkpoint."""
    import torch.distributed as dist
    if rank == 0:
        policy_folder(out)
        teacher_folder(out)
    dist.barrier()
    model = policy_folder(out)
    res: dict[str, Any] = {}
    for kind in KINDS:
        trainer, res[kind] = run(os.path.join(out, kind), kind, True, world, model)
        res[kind]["weights"] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        theirs, res[f"trl-{kind}"] = run(os.path.join(out, f"trl-{kind}"), kind, False, world, model)
        res[f"trl-{kind}"]["weights"] = {k: v.detach().clone() for k, v in theirs.model.state_dict().items()}
    _, whole = run(os.path.join(out, "resume"), "grpo", True, world, model, save_strategy="steps", save_steps=2)
    res["resume"] = {"whole": whole["logs"], "resumed": _resumed(out, world, model)}
    return res


def _resumed(out: str, world: int, model: str) -> list[dict[str, float]]:
    import trl

    import fz.hf
    settings = dict(KINDS["grpo"])
    settings.pop("trainer")
    args = fz.hf.on_fz(trl.GRPOConfig)(
        output_dir=os.path.join(out, "resume"), per_device_train_batch_size=GLOBAL_BATCH // world,
        gradient_accumulation_steps=2, num_generations=4, max_completion_length=8, max_steps=4, logging_steps=1,
        report_to=[], use_cpu=True, learning_rate=3e-2, save_strategy="no", disable_tqdm=True, bf16=False, seed=0,
        deepspeed=deepspeed(3), **settings)
    trainer = fz.hf.on_fz(trl.GRPOTrainer)(model=model, reward_funcs=words, args=args, train_dataset=prompts(),
                                           processing_class=tokenizer())
    trainer.train(resume_from_checkpoint=os.path.join(out, "resume", "checkpoint-2"))
    return [{k: float(h[k]) for k in LOGGED if k in h} for h in trainer.state.log_history if "loss" in h]
