"""A run's output_dir may hold what someone else put there: a `tmp-checkpoint-N` or `checkpoint-N`
that is a link, a trainer state naming another folder as the best. fz.hf.Trainer never writes
through such a link, never resumes from where one leads, and never deletes a checkpoint for a
best one outside the run."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import fz.hf  # noqa: E402
from fz.errors import ConfigError  # noqa: E402

from support import hf_pipeline as hp  # noqa: E402


def trainer(out: Path, **kw: Any) -> fz.hf.Trainer:
    settings: dict[str, Any] = dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=4,
                                    learning_rate=3e-3, use_cpu=True, report_to=[], save_strategy="steps",
                                    save_steps=2, seed=0, disable_tqdm=True, logging_steps=1)
    settings.update(kw)
    return fz.hf.Trainer(model=hp.llama(), args=fz.hf.TrainingArguments(**settings),
                         train_dataset=hp.causal_lm_data(), data_collator=hp.collator("lm"))


def test_a_staging_link_is_removed_not_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "config.json").write_text("mine")
    out = tmp_path / "run"
    out.mkdir()
    (out / "tmp-checkpoint-2").symlink_to(victim)
    trainer(out).train()
    assert sorted(p.name for p in victim.iterdir()) == ["config.json"]
    assert (victim / "config.json").read_text() == "mine"
    assert (out / "checkpoint-2").is_dir() and not (out / "checkpoint-2").is_symlink()


def test_resume_true_passes_over_a_checkpoint_link(tmp_path):
    other = tmp_path / "other"
    trainer(other, max_steps=2).train()
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint-999").symlink_to(other / "checkpoint-2")
    with pytest.raises(ConfigError, match="holds no complete checkpoint-N folder"):
        trainer(out).train(resume_from_checkpoint=True)


def test_a_best_checkpoint_outside_the_run_protects_nothing_and_deletes_nothing(tmp_path):
    """save_total_limit=1 keeps the best at the end: a best that is not one of the run's is none."""
    out = tmp_path / "run"
    trainer(out, max_steps=2).train()
    path = out / "checkpoint-2" / "trainer_state.json"
    saved = json.loads(path.read_text())
    outside = tmp_path / "elsewhere" / "checkpoint-7"
    outside.mkdir(parents=True)
    saved["best_model_checkpoint"], saved["best_global_step"] = str(outside), None
    path.write_text(json.dumps(saved))
    trainer(out, max_steps=6, save_total_limit=1).train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-6"]  # rotation kept the newest, as without a best
    assert outside.is_dir()


def test_save_model_writes_no_planted_link(tmp_path):
    """Every file of save_model's folder is staged and renamed; training_args.bin is made anew too."""
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    out = tmp_path / "run"
    out.mkdir()
    (out / "training_args.bin").symlink_to(victim)
    t = trainer(out, max_steps=1, save_strategy="no")
    t.train()
    t.save_model()
    assert victim.read_text() == "mine" and not (out / "training_args.bin").is_symlink()
    assert (out / "training_args.bin").read_bytes()[:2] == b"PK"  # torch.save's zip


def test_the_best_checkpoint_is_read_only_from_the_run_folder(tmp_path):
    """A resumed trainer state naming another run's checkpoint as the best, with a score no evaluation
    beats, made load_best_model_at_end end train() with that run's weights; it is ignored, warned."""
    import torch

    other = tmp_path / "other"
    trainer(other, max_steps=3, save_steps=3, learning_rate=0.1).train()
    out = tmp_path / "run"
    trainer(out, max_steps=2).train()
    path = out / "checkpoint-2" / "trainer_state.json"
    saved = json.loads(path.read_text())
    saved["best_model_checkpoint"], saved["best_metric"] = str(other / "checkpoint-3"), float("-inf")
    path.write_text(json.dumps(saved))
    args = fz.hf.TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, max_steps=4, learning_rate=0.5,
                                   use_cpu=True, report_to=[], save_strategy="steps", save_steps=2, seed=0,
                                   disable_tqdm=True, eval_strategy="steps", eval_steps=2, load_best_model_at_end=True)
    t = fz.hf.Trainer(model=hp.llama(), args=args, train_dataset=hp.causal_lm_data(), data_collator=hp.collator("lm"),
                      eval_dataset=hp.causal_lm_data()[:8])
    t.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    ours = {k: v.clone() for k, v in fz.full_params(t.fz_state).items()}
    theirs = fz.full_params(fz.load_weights(t.fz_state, str(other / "checkpoint-3")))  # the State given up
    assert any(not torch.equal(ours[k], theirs[k]) for k in ours)
    assert str(other) not in str(t.state.best_model_checkpoint)


def test_a_checkpoint_folder_whose_number_is_not_its_step_is_refused(tmp_path):
    """A copied-in checkpoint-99999999 holding step 2 was resumed by resume=True, and rotation then
    deleted each new checkpoint as older than it."""
    out = tmp_path / "run"
    trainer(out, max_steps=2).train()
    (out / "checkpoint-2").rename(out / "checkpoint-99999999")
    with pytest.raises(fz.CheckpointError, match=r"checkpoint-99999999 holds the trainer state of step 2, not "
                                                 r"99999999: renamed"):
        trainer(out, max_steps=4, save_total_limit=1).train(resume_from_checkpoint=True)


def test_a_checkpoint_of_another_name_or_in_another_run_resumes_as_in_transformers(tmp_path):
    """A complete checkpoint copied as `backup` resumes (its number is compared only in a checkpoint-N
    name); one resumed into another output_dir keeps its run's best, which load_best_model_at_end
    reads there at the end (it was refused after the whole run)."""
    import shutil

    first = tmp_path / "A"
    args = dict(per_device_train_batch_size=4, learning_rate=3e-3, use_cpu=True, report_to=[], save_strategy="steps",
                save_steps=1, seed=0, disable_tqdm=True, eval_strategy="steps", eval_steps=1,
                load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True)

    def run(out: Path, steps: int) -> fz.hf.Trainer:
        t = fz.hf.Trainer(model=hp.llama(), args=fz.hf.TrainingArguments(output_dir=str(out), max_steps=steps, **args),
                          train_dataset=hp.causal_lm_data(), data_collator=hp.collator("lm"),
                          eval_dataset=hp.causal_lm_data()[:8])
        return t
    run(first, 3).train()
    shutil.copytree(first / "checkpoint-3", tmp_path / "backup")
    run(tmp_path / "C", 4).train(resume_from_checkpoint=str(tmp_path / "backup"))
    t = run(tmp_path / "B", 4)
    t.train(resume_from_checkpoint=str(first / "checkpoint-3"))
    assert Path(t.state.best_model_checkpoint).parent in (first, tmp_path / "B")
