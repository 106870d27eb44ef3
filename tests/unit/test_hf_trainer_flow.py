"""fz.hf.Trainer's control flow against transformers.Trainer's own run of the same script, one
process: the callbacks it calls and what they are handed, a callback ending an epoch, train()
called twice, resuming with ignore_data_skip, an iterable dataset's epochs, the norm logged
without clipping, and what checkpoints and save_model write."""
from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch
import transformers
from transformers import TrainerCallback

import fz.hf
from fz.errors import ConfigError

from support import hf_pipeline as hp

EVENTS = ("on_epoch_begin", "on_step_begin", "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step",
          "on_step_end", "on_epoch_end")


class Recorder(TrainerCallback):
    """The events in order, and at each step's end what a callback reads of the optimizer and schedule."""

    def __init__(self, stop_epoch_at: int | None = None):
        self.events: list[str] = []
        self.lrs: list[tuple[float, float]] = []
        self.stop_epoch_at = stop_epoch_at
        for name in EVENTS:
            setattr(self, name, self._record(name))

    def _record(self, name: str) -> Any:
        def hook(args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.events.append(name)
            if name == "on_step_end":
                self.lrs.append((kw["lr_scheduler"].get_last_lr()[0], kw["optimizer"].param_groups[0]["lr"]))
                if state.global_step == self.stop_epoch_at:
                    control.should_epoch_stop = True
        return hook


class Rows(torch.utils.data.IterableDataset):
    def __init__(self, rows: list[dict[str, Any]]):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def trainer(on_fz: bool, out: str, callbacks: tuple = (), data: Any = None, model: Any = None, eval_data: Any = None,
            **kw: Any) -> Any:
    trainer_cls, args_cls = ((fz.hf.Trainer, fz.hf.TrainingArguments) if on_fz else
                             (transformers.Trainer, transformers.TrainingArguments))
    settings: dict[str, Any] = dict(
        output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_train_epochs=1,
        learning_rate=3e-3, weight_decay=0.01, warmup_steps=1, lr_scheduler_type="linear", logging_steps=1,
        use_cpu=True, report_to=[], save_strategy="no", seed=0, disable_tqdm=True, train_sampling_strategy="sequential")
    settings.update(kw)
    return trainer_cls(model=model or hp.llama(), args=args_cls(**settings), callbacks=list(callbacks),
                       train_dataset=hp.causal_lm_data() if data is None else data, data_collator=hp.collator("lm"),
                       eval_dataset=eval_data)


def logged(t: Any) -> list[tuple]:
    return [(h["loss"], h.get("grad_norm"), h["learning_rate"], h["epoch"], h["step"]) for h in t.state.log_history
            if "loss" in h]


def same(a: list[tuple], b: list[tuple]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x == pytest.approx(y, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("stop_epoch_at", [None, 2])
def test_callbacks_get_transformers_events_optimizer_and_schedule(tmp_path, stop_epoch_at):
    """on_substep_end / on_pre_optimizer_step / on_optimizer_step in transformers' order, the optimizer
    and scheduler they are handed read as transformers' do, and should_epoch_stop ending the epoch
    (2 epochs of 6 steps: the first ends at step 2, training at 8)."""
    runs = {}
    for on_fz in (False, True):
        rec = Recorder(stop_epoch_at)
        t = trainer(on_fz, str(tmp_path / str(on_fz)), (rec,), num_train_epochs=2)
        t.train()
        runs[on_fz] = rec, logged(t), t.state.global_step
    (ref, ref_logs, ref_steps), (got, got_logs, got_steps) = runs[False], runs[True]
    assert got.events == ref.events and "on_pre_optimizer_step" in got.events
    assert got.events.count("on_substep_end") == ref.events.count("on_substep_end") > 0
    assert [x for p in got.lrs for x in p] == pytest.approx([x for p in ref.lrs for x in p], rel=1e-6)
    assert got_steps == ref_steps == (8 if stop_epoch_at else 12)
    same(got_logs, ref_logs)


# What transformers.Trainer + DeepSpeed 0.19.8 logs as learning_rate for this run (lr 0.01, linear, no warmup,
# 4 steps), the config's optimizer section "auto": its engine steps the schedule inside backward, before the
# Trainer reads it, so each step logs the next one's lr (recorded with /work/venv-ds, world 1, ZeRO-2).
DEEPSPEED_LOGGED_LR = [0.0075, 0.005, 0.0025, 0.0]


@pytest.mark.parametrize("section", [True, False])
def test_the_logged_lr_is_transformers_or_deepspeeds_as_the_config_has_sections(tmp_path, section):
    """A DeepSpeed config with its own optimizer (or scheduler) section logs the next update's lr, as
    under DeepSpeed; without one, the update's own, as transformers (and DeepSpeed then) log it."""
    cfg = {**hp.deepspeed(2), **({"optimizer": {"type": "AdamW", "params": {
        "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}} if section else {})}
    settings = dict(max_steps=4, learning_rate=0.01, warmup_steps=0, weight_decay=0.0)
    ours = trainer(True, str(tmp_path / "fz"), deepspeed=cfg, **settings)
    ours.train()
    got = [x[2] for x in logged(ours)]
    if section:
        assert got == pytest.approx(DEEPSPEED_LOGGED_LR, abs=1e-12)
    else:
        ref = trainer(False, str(tmp_path / "hf"), **settings)
        ref.train()
        assert got == pytest.approx([x[2] for x in logged(ref)], abs=1e-12) == [0.01, 0.0075, 0.005, 0.0025]


def test_max_grad_norm_0_logs_the_norm_and_clips_nothing(tmp_path):
    ref, got = (trainer(f, str(tmp_path / str(f)), max_grad_norm=0.0) for f in (False, True))
    ref.train()
    got.train()
    assert all(n is not None for _, n, *_ in logged(got))
    same(logged(got), logged(ref))


def test_train_called_twice_goes_on_with_a_new_schedule_as_transformers(tmp_path):
    runs = []
    for on_fz in (False, True):
        t = trainer(on_fz, str(tmp_path / str(on_fz)), max_steps=3)
        t.train()
        t.train()  # the trained weights and the optimizer's moments; the schedule and the data anew
        runs.append(logged(t))
        assert t.state.global_step == 3
    same(runs[1], runs[0])


def test_resume_with_ignore_data_skip_reads_the_epoch_from_its_start(tmp_path):
    runs = []
    for on_fz in (False, True):
        out = str(tmp_path / str(on_fz))
        trainer(on_fz, out, save_strategy="steps", save_steps=3, max_steps=6).train()
        t = trainer(on_fz, out, save_strategy="no", max_steps=6, ignore_data_skip=True)
        t.train(resume_from_checkpoint=os.path.join(out, "checkpoint-3"))
        runs.append(logged(t))
    same(runs[1], runs[0])
    assert runs[1][0][3] < 0.5  # the epoch's first samples again


class Masking:
    """A collator drawing from torch's generator, as DataCollatorForLanguageModeling's masks do."""

    def __init__(self) -> None:
        self.inner = hp.collator("lm")

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.inner(rows)
        batch["labels"] = batch["labels"].masked_fill(torch.rand(batch["labels"].shape) < 0.3, -100)
        return batch


def test_resuming_at_an_epochs_end_draws_what_the_uninterrupted_run_draws(tmp_path):
    """save_strategy="epoch": the generator saved with checkpoint-6 (epoch 1's end) is set before
    epoch 2 reads its first batches, as transformers sets it: the resumed run's masks and losses
    are the uninterrupted run's, and transformers' own."""
    runs = []
    for on_fz in (False, True):
        out = str(tmp_path / str(on_fz))
        whole = trainer(on_fz, out, num_train_epochs=2, save_strategy="epoch")
        whole.data_collator = Masking()
        whole.train()
        resumed = trainer(on_fz, out, num_train_epochs=2)
        resumed.data_collator = Masking()
        resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-6"))
        runs.append((logged(whole)[6:], logged(resumed)[6:]))
        assert len(runs[-1][1]) == 6
    same(runs[1][1], runs[1][0])
    same(runs[1][1], runs[0][1])


def test_an_iterable_datasets_epoch_is_counted_as_transformers_counts_it(tmp_path):
    ref, got = (trainer(f, str(tmp_path / str(f)), data=Rows(hp.causal_lm_data()), max_steps=4)
                for f in (False, True))
    ref.train()
    got.train()
    same(logged(got), logged(ref))
    assert [x[3] for x in logged(got)] == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_checkpoints_and_save_model_hold_the_collators_tokenizer_and_the_arguments(tmp_path):
    t = trainer(True, str(tmp_path / "run"), save_strategy="steps", save_steps=2, max_steps=2)
    t.train()
    t.save_model(str(tmp_path / "final"))
    for folder in (tmp_path / "run" / "checkpoint-2", tmp_path / "final"):
        assert {"tokenizer.json", "tokenizer_config.json", "training_args.bin"} <= set(os.listdir(folder)), folder
        assert transformers.AutoTokenizer.from_pretrained(folder)("w1 w2")["input_ids"] == [5, 6]


class PlainLM(torch.nn.Module):
    """A language model that is not a transformers one (no config, no save_pretrained)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(hp.WORDS + 4, 16)
        self.head = torch.nn.Linear(16, hp.WORDS + 4)

    def forward(self, input_ids, labels=None, attention_mask=None):
        logits = self.head(torch.tanh(self.emb(input_ids)))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return {"loss": loss, "logits": logits}


@pytest.mark.parametrize("stage", [0, 3])
def test_save_model_of_a_plain_module_writes_its_state_dict_as_transformers(tmp_path, stage):
    """transformers' save_model writes a plain module's state_dict alone, in one model.safetensors:
    the same files, names and values (ZeRO-3: gathered from the State's shards)."""
    from safetensors.torch import load_file
    files = {}
    for on_fz in (False, True):
        out = str(tmp_path / str(on_fz))
        t = trainer(on_fz, out, model=PlainLM(), max_steps=2,
                    **({"deepspeed": hp.deepspeed(stage)} if on_fz and stage else {}))
        t.train()
        t.save_model(os.path.join(out, "final"))
        files[on_fz] = sorted(os.listdir(os.path.join(out, "final")))
        files[on_fz, "weights"] = load_file(os.path.join(out, "final", "model.safetensors"))
    assert files[True] == files[False] and "config.json" not in files[True]
    ref, got = files[False, "weights"], files[True, "weights"]
    assert sorted(got) == sorted(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)


def test_save_total_limit_1_leaves_the_best_checkpoint_alone_at_the_end(tmp_path):
    """Rotation keeps the newest beside the best while training; at the end transformers deletes
    all but the best (here the first: the highest eval loss is "best")."""
    left = []
    for on_fz in (False, True):
        out = tmp_path / str(on_fz)
        t = trainer(on_fz, str(out), eval_data=hp.causal_lm_data()[:8], max_steps=6, eval_strategy="steps",
                    eval_steps=2, save_strategy="steps", save_steps=2, save_total_limit=1,
                    metric_for_best_model="loss", greater_is_better=True)
        t.train()
        left.append((sorted(os.listdir(out)), os.path.basename(t.state.best_model_checkpoint)))
    assert left[1] == left[0] == (["checkpoint-2"], "checkpoint-2")


@pytest.mark.parametrize("stage, gather", [(None, False), (2, False), (3, False), (3, True)])
def test_a_checkpoint_holds_the_weights_where_transformers_and_deepspeed_write_them(tmp_path, stage, gather):
    """transformers' checkpoint-N has the weights (save_model) without DeepSpeed and at ZeRO-2, and at
    ZeRO-3 only with the 16-bit gather on save; `from_pretrained("checkpoint-N")` loads them there."""
    cfg = None if stage is None else {**hp.deepspeed(stage), "zero_optimization": {
        "stage": stage, "stage3_gather_16bit_weights_on_model_save": gather}}
    t = trainer(True, str(tmp_path), save_strategy="steps", save_steps=2, max_steps=2,
                **({"deepspeed": cfg} if cfg else {}))
    t.train()
    folder = tmp_path / "checkpoint-2"
    held = (folder / "model.safetensors").exists()
    assert held == (stage != 3 or gather) and (folder / "config.json").exists()
    if held:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
        assert all(torch.equal(v, t.model.state_dict()[k]) for k, v in loaded.items())


@pytest.mark.parametrize("deepspeed", [False, True])
def test_a_bf16_runs_model_and_save_are_in_the_dtype_transformers_holds(tmp_path, deepspeed):
    """Without DeepSpeed transformers' model stays fp32 and saves so (bf16 is autocast); under
    DeepSpeed its module is bf16, and saved so. fz.hf: the fp32 masters, or the bf16 copy."""
    from safetensors.torch import load_file
    dtypes = {}
    for on_fz in ((True,) if deepspeed else (False, True)):
        t = trainer(on_fz, str(tmp_path / str(on_fz)), max_steps=2, bf16=True,
                    **({"deepspeed": {**hp.deepspeed(2), "bf16": {"enabled": "auto"}}} if deepspeed else {}))
        t.train()
        t.save_model(str(tmp_path / str(on_fz) / "final"))
        dtypes[on_fz] = {v.dtype for v in load_file(tmp_path / str(on_fz) / "final" / "model.safetensors").values()}
        dtypes[on_fz, "model"] = {p.dtype for p in t.model.parameters()}  # DeepSpeed's module is cast whole
    assert dtypes[True] == dtypes[True, "model"] == {torch.bfloat16 if deepspeed else torch.float32}
    assert deepspeed or dtypes[False] == dtypes[False, "model"] == {torch.float32}  # transformers' own


def test_save_only_model_writes_the_weights_and_refuses_to_resume_from_them(tmp_path):
    out = tmp_path / "run"
    t = trainer(True, str(out), save_strategy="steps", save_steps=2, max_steps=2, save_only_model=True)
    t.train()
    folder = out / "checkpoint-2"
    assert "fz" not in os.listdir(folder) and "trainer_state.json" in os.listdir(folder)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    trained = t.model.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())
    with pytest.raises(ConfigError, match="save_only_model=True: it holds the model's weights"):
        trainer(True, str(out), max_steps=4).train(resume_from_checkpoint=str(folder))


def test_a_checkpoint_of_transformers_without_deepspeed_is_named_so(tmp_path):
    """It was called a save_only_model=True checkpoint; it holds torch's optimizer state, which fz does not read."""
    out = tmp_path / "run"
    trainer(False, str(out), save_strategy="steps", save_steps=2, max_steps=2).train()
    with pytest.raises(ConfigError, match=r"checkpoint-2 was saved by transformers' Trainer without DeepSpeed \(its "
                                          r"optimizer.pt is a torch optimizer's state\)"):
        trainer(True, str(out), max_steps=4).train(resume_from_checkpoint=str(out / "checkpoint-2"))


def test_memory_metrics_are_reported_as_transformers_reports_them(tmp_path):
    """skip_memory_metrics=False: fz's train() never stopped transformers' tracker, so its metrics had no
    train_mem_*, and every evaluate() after it none of its eval_mem_* (taken for a call nested in train)."""
    keys = {}
    for on_fz in (False, True):
        t = trainer(on_fz, str(tmp_path / str(on_fz)), max_steps=2, skip_memory_metrics=False,
                    eval_data=hp.causal_lm_data()[:4])
        keys[on_fz] = ({k for k in t.train().metrics if "_mem_" in k}, {k for k in t.evaluate() if "_mem_" in k})
    assert keys[True] == keys[False] and "train_mem_cpu_alloc_delta" in keys[True][0], keys
    assert "eval_mem_cpu_peaked_delta" in keys[True][1]


RANGES = {"interval_zero": ("logging_steps", 0, "not a finite number > 0"),
          "interval_inf": ("save_steps", 1e999, "not a finite number > 0"),
          "negative_step": ("global_step", -1, "not a whole number from 0 to 2"),
          "best_elsewhere": ("best_model_checkpoint", "/etc", "not the path of a checkpoint-N folder")}


@pytest.mark.parametrize("tamper", ["link_out", "unknown_key", "not_json", "sparse", "deep", "wrong_type",
                                    "callback_args", "fz_out", *RANGES])
def test_a_tampered_trainer_state_is_refused_before_the_state_is_restored(tmp_path, tamper):
    """trainer_state.json is read as a regular file inside the checkpoint, bounded and not too deep, an
    object of TrainerState's fields of their types whose callbacks this run's take, before fz.restore
    takes the State (nor may fz/ lead out): the trainer can still train after the refusal."""
    import json
    import shutil

    from fz.errors import CheckpointError
    out = tmp_path / "run"
    trainer(True, str(out), save_strategy="steps", save_steps=2, max_steps=2).train()
    path = out / "checkpoint-2" / "trainer_state.json"
    if tamper in ("link_out", "fz_out"):
        secret = tmp_path / "secret.json"
        secret.write_text('{"log_history": [{"CANARY": 1}]}')
        if tamper == "fz_out":
            secret = tmp_path / "elsewhere"
            shutil.move(out / "checkpoint-2" / "fz", secret)
            path = out / "checkpoint-2" / "fz"
        path.unlink(missing_ok=True)
        path.symlink_to(secret)
    elif tamper == "unknown_key":
        path.write_text('{"global_step": 2, "evil": 1}')
    elif tamper == "sparse":
        os.truncate(path, 300 << 20)
    elif tamper == "deep":
        path.write_text("[" * 5000 + "]" * 5000)
    elif tamper in ("wrong_type", "callback_args", *RANGES):
        saved = json.loads(path.read_text())
        if tamper in RANGES:
            saved[RANGES[tamper][0]] = RANGES[tamper][1]
        elif tamper == "wrong_type":
            saved["logging_steps"] = "1"
        else:
            saved["stateful_callbacks"]["TrainerControl"]["args"]["evil"] = 1
        path.write_text(json.dumps(saved))
    else:
        path.write_text("{not json")
    state = r"^the trainer state \S+trainer_state.json"
    words = {"link_out": rf"{state} leads to \S+secret.json, outside the checkpoint folder",
             "unknown_key": r"keys TrainerState has not: \['evil'\]", "not_json": f"{state} is not JSON",
             "sparse": rf"{state} is 314572800 bytes, over the 256 MiB", "deep": rf"{state} nests deeper",
             "wrong_type": rf"{state}: logging_steps is '1', not int or float: damaged",
             "callback_args": rf"{state}: its stateful_callbacks do not make this run's callbacks \(TypeError",
             "fz_out": r"^fz's checkpoint \S+fz leads to \S+elsewhere, outside the checkpoint folder",
             **{k: rf"{state}: {f} is .*: {why}" for k, (f, _, why) in RANGES.items()}}
    t = trainer(True, str(out), max_steps=4, restore_callback_states_from_checkpoint=True)
    with pytest.raises(CheckpointError, match=words[tamper]):
        t.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert t.train().global_step == 4  # its State was not given to the refused restore


@pytest.mark.parametrize("explicit", [True, False])
def test_a_transformers_and_deepspeed_checkpoint_without_deepspeeds_files_is_refused_before_anything_changes(
        tmp_path, explicit):
    """Its checkpoint-N holds DeepSpeed's `latest` and global_stepN/ (and at ZeRO-2 model.safetensors):
    read as DeepSpeed's (tests/multirank/test_hf_ds_resume.py resumes from real ones); with the
    tag folder empty, the error names DeepSpeed's checkpoint, and the Trainer still trains."""
    import json
    folder = tmp_path / "checkpoint-2"
    (folder / "global_step2").mkdir(parents=True)
    (folder / "latest").write_text("global_step2")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    (folder / "model.safetensors").write_bytes(b"")
    from fz.errors import CheckpointError
    t = trainer(True, str(tmp_path), max_steps=4)
    with pytest.raises(CheckpointError, match=r"^DeepSpeed checkpoint \S+checkpoint-2: tag 'global_step2' not found"):
        t.train(resume_from_checkpoint=str(folder) if explicit else True)
    assert t.train().global_step == 4


def test_metrics_name_the_model_preparation_as_transformers_does(tmp_path):
    """An evaluation before training prepares the model (fz: makes the State) and says how long it
    took, in every later evaluation and prediction too; one after training does not."""
    keys = {}
    for on_fz in (False, True):
        first = trainer(on_fz, str(tmp_path / f"a{on_fz}"), eval_data=hp.causal_lm_data(), max_steps=1)
        seen = [sorted(first.evaluate())]
        first.train()
        seen += [sorted(first.evaluate()), sorted(first.predict(hp.causal_lm_data()).metrics)]
        later = trainer(on_fz, str(tmp_path / f"b{on_fz}"), eval_data=hp.causal_lm_data(), max_steps=1)
        later.train()
        seen += [sorted(later.evaluate()), sorted(later.predict(hp.causal_lm_data()).metrics)]
        keys[on_fz] = seen
    assert keys[True] == keys[False]
    assert "eval_model_preparation_time" in keys[True][0] and "test_model_preparation_time" in keys[True][2]
    assert not any("preparation" in k for k in keys[True][3] + keys[True][4])


def test_training_says_where_the_model_states_live(tmp_path, caplog):
    """With offload, the run's first line names each tier's bytes (a user never saw where the
    state lived without calling fz.memory_report)."""
    cfg = {**hp.deepspeed(3), "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                    "offload_param": {"device": "cpu"}}}
    t = trainer(True, str(tmp_path), deepspeed=cfg, max_steps=1)
    with caplog.at_level(logging.INFO, logger="fz.hf.trainer"):
        t.train()
    said = next(r.getMessage() for r in caplog.records if "steps of" in r.getMessage())
    host = fz.memory_report(t.fz_state).tiers["host"]
    assert said.endswith(f"ZeRO stage 3 over 1 ranks; this rank's model states: device "
                         f"{sum(fz.memory_report(t.fz_state).tiers['device'].values()) / 2**20:.2f} MiB, "
                         f"host {sum(host.values()) / 2**20:.2f} MiB"), said
    assert host["params"] and host["moments"]


def test_a_subclass_loss_context_is_entered_per_micro_step_and_its_log_save_evaluate_named(tmp_path, caplog):
    """compute_loss_context_manager of a subclass wraps each training loss, as transformers' training_step
    enters it (it applied in evaluation only); _maybe_log_save_evaluate, which fz's loop does not call, is
    named when the trainer is made (it was skipped in silence)."""
    import contextlib

    entered = {}
    for on_fz in (False, True):
        base = fz.hf.Trainer if on_fz else transformers.Trainer
        count = entered.setdefault(on_fz, [0])

        class Own(base):  # type: ignore[misc, valid-type]
            counted = count

            def compute_loss_context_manager(self):
                self.counted[0] += 1
                return contextlib.nullcontext()

            def _maybe_log_save_evaluate(self, *args, **kwargs):
                return super()._maybe_log_save_evaluate(*args, **kwargs)

        t = trainer(on_fz, str(tmp_path / str(on_fz)), max_steps=3)
        with caplog.at_level(logging.WARNING, logger="fz.hf.replaced"):
            own = Own(model=t.model, args=t.args, train_dataset=t.train_dataset, data_collator=t.data_collator)
        own.train()
    assert entered[True] == entered[False] == [6]  # 3 steps of 2 micro-batches
    assert any("Own._maybe_log_save_evaluate is not called on fz" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("stage", [0, 2])
def test_after_training_the_model_shares_the_states_weights_at_zero_0_to_2(tmp_path, stage):
    """trainer.model held a copy of its own beside the State's after train() (twice the weights'
    memory, on the device on a GPU); DeepSpeed's module shares its engine's. Its values are the
    trained ones, and a second train() goes on from them."""
    t = trainer(True, str(tmp_path), deepspeed=hp.deepspeed(stage), max_steps=2)
    t.train()
    flats = [f._local_tensor for f in t.fz_state.param_flats]
    spans = [(f.data_ptr(), f.data_ptr() + f.numel() * f.element_size()) for f in flats]
    full = fz.full_params(t.fz_state)
    for name, p in t.model.named_parameters():
        assert any(lo <= p.data_ptr() < hi for lo, hi in spans), name
        assert torch.equal(p.data, full[name]), name
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    t.train()
    assert any(not torch.equal(p.data, before[n]) for n, p in t.model.named_parameters())


def test_after_training_a_lora_base_is_the_models_own_and_no_fill_copies_twice(tmp_path, monkeypatch):
    """Only trained parameters share the State's storage: PEFT's merge_adapter writes into the frozen
    base in place, and evaluate() (fz's own forward, the adapter still in it) then added it twice.
    A let-go and fill of views (an online trainer's update, a second train()) copies nothing."""
    peft = pytest.importorskip("peft")
    from fz.hf import model_weights
    model = peft.get_peft_model(hp.llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                            init_lora_weights=False))
    args = fz.hf.TrainingArguments(str(tmp_path), per_device_train_batch_size=4, max_steps=2, use_cpu=True,
                                   report_to=[], disable_tqdm=True, save_strategy="no", deepspeed=hp.deepspeed(2))
    t = fz.hf.Trainer(model=model, args=args, train_dataset=hp.causal_lm_data(), data_collator=hp.collator("lm"),
                      eval_dataset=hp.causal_lm_data()[:8])
    t.train()
    before = t.evaluate()["eval_loss"]
    t.model.merge_adapter()
    assert t.evaluate()["eval_loss"] == pytest.approx(before, abs=1e-6)
    t.model.unmerge_adapter()
    copies = []
    real = model_weights.copy_full_params
    monkeypatch.setattr(model_weights, "copy_full_params", lambda *a: copies.append(1) or real(*a))
    plain = trainer(True, str(tmp_path / "plain"), deepspeed=hp.deepspeed(2), max_steps=2)
    plain.train()
    plain._let_go_of_weights()
    plain._copy_weights_into_model()
    assert copies == [] and t.evaluate()["eval_loss"] == pytest.approx(before, abs=1e-6)
