"""Rank functions of tests/multirank/test_hf_trainer_crash.py: an fz.hf.Trainer run (ZeRO-3, world 2,
random sampling across an epoch boundary, a save every 2 steps) in which one rank SIGKILLs itself
at a chosen point of the save of checkpoint-N, then `resume_from_checkpoint=True`."""
from __future__ import annotations

import os
import signal
from typing import Any

from support.hf_pipeline import causal_lm_data, collator, deepspeed, llama

STEPS = 8


def _kill_in_state_json() -> None:
    """SIGKILL as the Trainer writes trainer_state.json (fz's checkpoint is complete by then)."""
    from transformers.trainer_callback import TrainerState

    def killed(self: Any, path: str) -> None:
        os.kill(os.getpid(), signal.SIGKILL)
    TrainerState.save_to_json = killed  # type: ignore[method-assign]


def train(rank: int, world: int, out: str, kill: tuple[int, int, str] | None, resume: bool) -> dict[str, Any]:
    """`kill`: (step whose save is hit, rank that dies, point: "fz_write", "fz_commit" or "state_json")."""
    import transformers

    import fz.hf

    from support import ckpt_hooks

    class Crash(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if kill is None or state.global_step != kill[0] or rank != kill[1]:
                return
            point = kill[2]
            if point == "state_json":
                _kill_in_state_json()
            else:  # fz's checkpoint: as DCP starts writing this rank's part / after the step folder's rename
                ckpt_hooks.arm("write_begin" if point == "fz_write" else "renamed", "kill")

    args = fz.hf.TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                   max_steps=STEPS, save_strategy="steps", save_steps=2, logging_steps=1,
                                   learning_rate=3e-3, warmup_steps=1, seed=3, use_cpu=True, report_to=[],
                                   deepspeed=deepspeed(3), disable_tqdm=True)
    trainer = fz.hf.Trainer(model=llama(), args=args, train_dataset=causal_lm_data(), data_collator=collator("lm"),
                            callbacks=[Crash()])
    trainer.train(resume_from_checkpoint=True if resume else None)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"steps": [h["step"] for h in logs], "losses": [h["loss"] for h in logs],
            "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "listing": sorted(os.listdir(out)) if rank == 0 else []}
