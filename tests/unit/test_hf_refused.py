"""Trainer subclasses whose step is the algorithm (a user's override of training_step) and TRL
arguments whose work fz's loop would skip are refused when the trainer is made, naming them:
before, a synced DPO reference silently stayed as it was. TRL's trainers whose step only wraps
activation offloading still run, and GRPO and RLOO run as written (fz/hf/online.py)."""
from __future__ import annotations

import datasets
import pytest
import transformers

import fz.hf
from fz.errors import ConfigError

from support import hf_pipeline as hp

trl = pytest.importorskip("trl")


def _settings(out, **kw):
    return dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=1, report_to=[], use_cpu=True,
                disable_tqdm=True, **kw)


def test_grpo_is_made_but_a_subclass_overriding_its_step_is_refused(tmp_path):
    """GRPO's own step only counts micro-steps (fz/hf/online.py runs its _prepare_inputs); a user's
    override of it is what fz's loop would not run."""
    Trainer, Config = fz.hf.on_fz(trl.GRPOTrainer), fz.hf.on_fz(trl.GRPOConfig)
    prompts = datasets.Dataset.from_dict({"prompt": ["w1 w2 w3", "w4 w5 w6", "w7 w8 w9", "w1 w3 w5"]})
    args = Config(**_settings(tmp_path, num_generations=4, max_completion_length=4, generation_batch_size=4))
    kw = dict(model=hp.llama(), reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
              train_dataset=prompts, processing_class=hp.tokenizer())
    assert Trainer(**kw).train().global_step == 1

    class Mine(trl.GRPOTrainer):
        def training_step(self, *args, **kwargs):
            return super().training_step(*args, **kwargs)
    with pytest.raises(ConfigError, match=r"Mine.training_step is overridden: fz's loop runs fz.train_step"):
        fz.hf.on_fz(Mine)(**kw)
    kw["args"] = Config(**_settings(tmp_path, num_generations=4, max_completion_length=4, generation_batch_size=4,
                                    ds3_gather_for_generation=False))
    with pytest.raises(ConfigError, match=r"ds3_gather_for_generation=False: fz generates with the whole weights"):
        Trainer(**kw)


def test_a_trl_trainer_fz_does_not_run_is_refused_naming_the_ones_it_does(tmp_path):
    """TRL's experimental Online DPO generates and backpropagates inside its own training_step:
    refused when made, not a TypeError at the first step."""
    online_dpo = pytest.importorskip("trl.experimental.online_dpo")
    Trainer, Config = fz.hf.on_fz(online_dpo.OnlineDPOTrainer), fz.hf.on_fz(online_dpo.OnlineDPOConfig)
    rows = datasets.Dataset.from_dict({"prompt": hp.texts(4)})
    with pytest.raises(ConfigError, match=r"OnlineDPOTrainer.training_step: TRL's OnlineDPOTrainer is not one fz runs "
                                          r".* fz runs TRL's SFT, DPO, Reward, KTO, GRPO, RLOO, Distillation and GKD "
                                          "trainers"):
        Trainer(model=hp.llama(), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                args=Config(**_settings(tmp_path)), train_dataset=rows, processing_class=hp.tokenizer())


def test_a_subclass_step_is_refused_and_trl_arguments_fz_would_skip_too(tmp_path):
    class Mine(transformers.Trainer):
        def training_step(self, *args, **kwargs):
            return super().training_step(*args, **kwargs)
    with pytest.raises(ConfigError, match=r"Mine.training_step is overridden"):
        fz.hf.on_fz(Mine)(model=hp.llama(), args=fz.hf.TrainingArguments(**_settings(tmp_path)),
                          train_dataset=hp.causal_lm_data(), data_collator=hp.collator("lm"))
    rows = datasets.Dataset.from_dict({"text": hp.texts(8)})
    args = fz.hf.on_fz(trl.SFTConfig)(**_settings(tmp_path, activation_offloading=True))
    with pytest.raises(ConfigError, match="activation_offloading=True: TRL offloads activations inside its"):
        fz.hf.on_fz(trl.SFTTrainer)(model=hp.llama(), args=args, train_dataset=rows, processing_class=hp.tokenizer())


def test_sft_whose_step_wraps_activation_offloading_still_trains(tmp_path):
    rows = datasets.Dataset.from_dict({"text": hp.texts(8)})
    args = fz.hf.on_fz(trl.SFTConfig)(**_settings(tmp_path))
    trainer = fz.hf.on_fz(trl.SFTTrainer)(model=hp.llama(), args=args, train_dataset=rows,
                                          processing_class=hp.tokenizer())
    assert trainer.train().global_step == 1


def test_a_synced_dpo_reference_is_refused(tmp_path):
    from support import trl_jobs
    Trainer, Config = trl_jobs.classes("dpo_ref", True)
    args = Config(**_settings(tmp_path, sync_ref_model=True, ref_model_sync_steps=1))
    with pytest.raises(ConfigError, match="sync_ref_model=True: TRL's SyncRefModelCallback"):
        Trainer(model=hp.llama(), ref_model=hp.llama(), args=args, train_dataset=trl_jobs.dataset("dpo_ref"),
                processing_class=hp.tokenizer())
