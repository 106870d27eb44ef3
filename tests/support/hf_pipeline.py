"""A Hugging Face training script as people write it (issue 39), made here without downloads: a
word-level tokenizer, texts of 3-19 words, a tiny Llama, transformers' own collators, a
DeepSpeed dict with "auto" values. The rank functions of tests/multirank/test_hf_trainer_pipeline.py
run it on fz.hf.Trainer (world 2) and on transformers.Trainer (world 1, the same global batch)."""
from __future__ import annotations

import os
from typing import Any

import torch

WORDS, TEXTS = 60, 44  # 44 samples: an epoch of 16-sample steps ends with a step of 12


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": 4 + i for i in range(WORDS)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def texts(n: int = TEXTS, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, 20, (1,), generator=g))
        out.append(" ".join(f"w{int(i)}" for i in torch.randint(0, WORDS, (length,), generator=g)))
    return out


def causal_lm_data(kind: str = "lm") -> list[dict[str, Any]]:
    """Tokenized texts (lists, unpadded) for a causal LM: "lm" (and "mean") for
    DataCollatorForLanguageModeling, "seq2seq" with labels = input_ids for DataCollatorForSeq2Seq,
    "classes" with a label per text."""
    tk = tokenizer()
    rows = []
    for i, text in enumerate(texts()):
        row = dict(tk(text))
        if kind == "seq2seq":
            row["labels"] = list(row["input_ids"])
        elif kind == "classes":
            row["labels"] = i % 3
        rows.append(row)
    return rows


def llama(classes: bool = False, mean: bool = False) -> torch.nn.Module:
    """The tiny Llama; `mean`: one that takes no num_items_in_batch (transformers then averages each
    micro-batch and divides by the accumulation steps)."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4 + WORDS, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                      num_labels=3)
    model = LlamaForSequenceClassification(cfg) if classes else LlamaForCausalLM(cfg)
    if mean:
        model.accepts_loss_kwargs = False  # what transformers reads first
    return model


def t5() -> torch.nn.Module:
    """A tiny T5 (an encoder-decoder), seeded."""
    torch.manual_seed(0)
    import transformers
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=2,
                                   dropout_rate=0.0)
    return transformers.T5ForConditionalGeneration(config)


def seq2seq_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """Tokenized texts with their first words reversed as the target, for a T5."""
    tk = tokenizer()
    out = []
    for text in texts(n, seed):
        ids = tk(text)["input_ids"]
        out.append({"input_ids": ids, "labels": list(reversed(ids))[:6] + [2]})
    return out


class Masking:
    """DataCollatorForLanguageModeling(mlm=False), then labels masked with draws from torch's, numpy's
    and random's generators, as an MLM collator's masks (and a user's augmentation) draw."""

    def __init__(self) -> None:
        from transformers import DataCollatorForLanguageModeling
        self.inner = DataCollatorForLanguageModeling(tokenizer(), mlm=False)

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        import random

        import numpy as np
        batch = self.inner(rows)
        shape = batch["labels"].shape
        drawn = torch.rand(shape) + torch.from_numpy(np.random.rand(*shape)).float() + random.random()
        batch["labels"] = batch["labels"].masked_fill(drawn < 1.0, -100)
        return batch


def collator(kind: str) -> Any:
    from transformers import DataCollatorForLanguageModeling, DataCollatorForSeq2Seq
    if kind in ("lm", "mean"):
        return DataCollatorForLanguageModeling(tokenizer(), mlm=False)
    if kind == "masked":
        return Masking()
    if kind == "seq2seq":
        return DataCollatorForSeq2Seq(tokenizer())
    return None  # "classes": the Trainer's default with processing_class=tokenizer, DataCollatorWithPadding


def deepspeed(stage: int) -> dict[str, Any]:
    """A ZeRO config with "auto" values and no optimizer or scheduler section: the Trainer's own
    (AdamW, linear warmup and decay) then train, under DeepSpeed too, as in plain transformers."""
    return {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto"}


def run(out: str, on_fz: bool, *, kind: str = "lm", accum: int = 1, stage: int | None = None, world: int = 1,
        **kw: Any) -> dict[str, Any]:
    """One training run; what it logged, its final weights and counters. The global batch is 4 x accum:
    per device 4 / world."""
    import transformers

    import fz.hf
    trainer_cls, args_cls = ((fz.hf.Trainer, fz.hf.TrainingArguments) if on_fz else
                             (transformers.Trainer, transformers.TrainingArguments))
    settings: dict[str, Any] = dict(
        output_dir=out, per_device_train_batch_size=4 // world, gradient_accumulation_steps=accum,
        num_train_epochs=1, learning_rate=3e-3, weight_decay=0.01, warmup_steps=1, lr_scheduler_type="linear",
        logging_steps=1, use_cpu=True, report_to=[], save_strategy="no", seed=0, disable_tqdm=True,
        train_sampling_strategy="sequential")
    if stage is not None:
        settings["deepspeed"] = deepspeed(stage)
    settings.update({k: v for k, v in kw.items() if k != "rows"})
    gathered: list[int] = []

    class Recording(trainer_cls):  # type: ignore[misc, valid-type]
        """What TRL's metrics sum through accelerate's gather_for_metrics (num_tokens...): each rank's rows."""

        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            sampler = super()._get_train_sampler(train_dataset)
            return seeded_groups(sampler, self.args.seed) if grouped(settings) and not on_fz else sampler

        def compute_loss(self, model, inputs, *args, **kwargs):
            mine = torch.tensor([len(inputs["input_ids"])])
            gathered.append(int(self.accelerator.gather_for_metrics(mine).sum()))
            return super().compute_loss(model, inputs, *args, **kwargs)

    trainer = Recording(model=llama(kind == "classes", kind == "mean"), args=args_cls(**settings),
                        train_dataset=causal_lm_data(kind)[:kw.get("rows")], data_collator=collator(kind),
                        processing_class=tokenizer() if kind == "classes" else None)
    result = trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"losses": [h["loss"] for h in logs], "epochs": [h["epoch"] for h in logs],
            "lrs": [h["learning_rate"] for h in logs], "norms": [h.get("grad_norm") for h in logs],
            "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "train_loss": result.training_loss, "total_flos": trainer.state.total_flos,
            "tokens_seen": trainer.state.num_input_tokens_seen, "steps": trainer.state.global_step,
            "gathered": gathered, "problem_type": getattr(trainer.model.config, "problem_type", None)}


def grouped(settings: dict[str, Any]) -> bool:
    return settings.get("train_sampling_strategy") == "group_by_length"


def at_world_2(name: str) -> bool:
    """Whether transformers' run for `name` is at world 2: its loss or its groups depend on the world size."""
    kind, _, _, extra = RUNS[name]
    return kind in AT_WORLD_2 or grouped(extra)


def seeded_groups(sampler: Any, seed: int) -> Any:
    """transformers' group_by_length sampler, drawing from the process's generator as it does, but
    grouping a shuffle seeded by seed + epoch (accelerate calls set_epoch), as fz.hf's does."""
    from transformers.trainer_pt_utils import LengthGroupedSampler, get_length_grouped_indices

    class Seeded(LengthGroupedSampler):
        epoch = 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self):
            torch.randperm(len(self.lengths))  # transformers' own draw
            shuffle = torch.Generator().manual_seed(seed + self.epoch)
            return iter(get_length_grouped_indices(self.lengths, self.batch_size, generator=shuffle))

    return Seeded(sampler.batch_size, lengths=sampler.lengths)


RUNS = {  # name: (kind, accumulation, ZeRO stage on fz, extra arguments)
    "lm_ga1_z2": ("lm", 1, 2, {}), "lm_ga4_z2": ("lm", 4, 2, {}),
    "lm_ga1_z3": ("lm", 1, 3, {}), "lm_ga4_z3": ("lm", 4, 3, {}),
    "random_ga2_z3": ("lm", 2, 3, {"train_sampling_strategy": "random", "seed": 5}),
    "lm_z0": ("lm", 2, 0, {"include_num_input_tokens_seen": "non_padding"}),
    "seq2seq_z0": ("seq2seq", 2, 0, {}), "seq2seq_z3": ("seq2seq", 2, 3, {}),
    "classes_z0": ("classes", 2, 0, {}), "classes_z3": ("classes", 2, 3, {}),
    "mean_z3": ("mean", 2, 3, {}),
    "mean_odd_z2": ("mean", 2, 2, {"rows": 41}),  # 41 % 4: the epoch's last global batch holds 1 sample
    "smoothed_ga2_z3": ("lm", 2, 3, {"label_smoothing_factor": 0.1}),
    "grouped_ga2_z3": ("lm", 2, 3, {"train_sampling_strategy": "group_by_length", "seed": 5, "num_train_epochs": 2}),
    "masked_workers_z2": ("masked", 2, 2, {"dataloader_num_workers": 2, "num_train_epochs": 2}),
}


# transformers' own loss for these depends on the world size, so they are compared with
# transformers' Trainer at world 2 (DDP over gloo), in the same processes: LlamaForSequenceClassification
# takes num_items_in_batch but its loss does not use it (and compute_loss still multiplies by the
# ranks); a model that takes none averages each micro-batch, of 2 rows at world 2 and 4 at world 1
AT_WORLD_2 = ("classes", "mean", "masked")  # "masked": each rank's dataloader workers draw its own masks


def reference_key(name: str) -> str:
    """The transformers run a fz run compares with (it has no ZeRO stage)."""
    kind, accum, _, extra = RUNS[name]
    rows = f"_rows{extra['rows']}" if "rows" in extra else ""
    smoothed = f"_smoothed{extra['label_smoothing_factor']}" if "label_smoothing_factor" in extra else ""
    return f"{kind}_ga{accum}_{extra.get('train_sampling_strategy', 'sequential')}{rows}{smoothed}"


def fz_runs(rank: int, world: int, out: str) -> dict[str, Any]:
    """Every run of RUNS on fz.hf.Trainer (and transformers' at this world size where AT_WORLD_2),
    then the calls one rank makes alone."""
    res = {}
    for name, (kind, accum, stage, extra) in RUNS.items():
        res[name] = run(os.path.join(out, name), True, kind=kind, accum=accum, stage=stage, world=world, **extra)
        key = reference_key(name)
        if at_world_2(name) and key not in res:
            res[key] = run(os.path.join(out, "ddp-" + key), False, kind=kind, accum=accum, world=world, **extra)
    res["one_rank"] = one_rank_calls(rank, out)
    return res


def reference_runs(rank: int, world: int, out: str) -> dict[str, Any]:
    res = {}
    for name, (kind, accum, _, extra) in RUNS.items():
        key = reference_key(name)
        if key not in res and not at_world_2(name):
            res[key] = run(os.path.join(out, "ref-" + key), False, kind=kind, accum=accum, **extra)
    return res


def _meet(name: str, ranks, rank: int) -> None:
    """Both ranks past the one-rank call. The other rank's heartbeat may still say it waits
    elsewhere for a moment after it left (published every 0.5 s), and then this check-in fails
    first: try again (a failed one leaves no trace), bounded. Neither rank waits alone here, so
    the retries end as soon as the heartbeat catches up."""
    import time

    import fz
    for _ in range(60):
        try:
            return fz.distributed.arrive(name, ranks, rank)
        except fz.ConfigError:
            time.sleep(0.5)
    fz.distributed.arrive(name, ranks, rank)


def _elsewhere(flag: str, ranks) -> None:
    """Wait as a rank busy in another collective does, until the lone caller says it is done (`flag`).
    Not a second arrive: one that saw the lone caller stuck first would leave at once, before it
    was seen stuck itself, and the lone caller would then wait for Spec.timeout_s (a CI flake)."""
    import time

    from fz.distributed import peers
    store = peers.store_for(ranks)
    assert store is not None, "two ranks of a running job"
    peers.doing("test/elsewhere")
    deadline = time.monotonic() + 240
    with peers.waiting():
        while not peers.call(lambda: store.check([flag])):
            assert time.monotonic() < deadline, f"{flag}: the lone call did not end"
            time.sleep(0.05)


def one_rank_calls(rank: int, out: str) -> dict[str, Any]:
    """save_model on rank 0 alone (under `if trainer.is_world_process_zero():`), evaluate on rank 1
    alone; each error's text and how long it took; then a resume from a folder that is not a checkpoint."""
    import time

    import fz
    import fz.hf
    from fz.distributed import peers
    args = fz.hf.TrainingArguments(output_dir=os.path.join(out, "one"), per_device_train_batch_size=2,
                                   max_steps=2, use_cpu=True, report_to=[], save_strategy="steps", save_steps=1,
                                   deepspeed=deepspeed(3), disable_tqdm=True)
    trainer = fz.hf.Trainer(model=llama(), args=args, train_dataset=causal_lm_data(),
                            data_collator=collator("lm"), eval_dataset=causal_lm_data()[:8])
    trainer.train()
    got: dict[str, Any] = {}
    for call, who in (("save_model", 0), ("evaluate", 1)):
        ranks, flag = trainer.fz_state.plan.ranks, f"test/done/{call}"
        start = time.monotonic()
        if rank == who:
            try:
                getattr(trainer, call)()
            except fz.ConfigError as e:
                got[call] = (str(e), time.monotonic() - start)
            finally:  # whatever the call did, the other rank stops waiting
                peers.store_for(ranks).set(flag, "1")
        else:
            _elsewhere(flag, ranks)  # busy in another call
        _meet(f"test/after/{call}", ranks, rank)  # both done with it
    try:
        trainer.train(resume_from_checkpoint=os.path.join(out, "one", "runs"))
    except fz.ConfigError as e:
        got["resume"] = str(e)
    got["model_call"] = _model_called_on_one_rank_while_training(rank, out)
    return got


def _model_called_on_one_rank_while_training(rank: int, out: str) -> tuple[str, float]:
    """A callback calling trainer.model on rank 0 alone after an update at ZeRO-3 (a sample under
    `if rank == 0:`): the error's text and how long it took; both ranks then train on."""
    import time

    from transformers import TrainerCallback

    import fz.hf
    from fz.distributed import peers
    said: list[tuple[str, float]] = []

    class Sample(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if state.global_step != 1:
                return
            ranks, flag = trainer.fz_state.plan.ranks, "test/done/model_call"
            start = time.monotonic()
            if rank == 0:
                try:
                    model(input_ids=torch.tensor([[3, 4, 5]]))
                except fz.ConfigError as e:
                    said.append((str(e), time.monotonic() - start))
                finally:
                    peers.store_for(ranks).set(flag, "1")
            else:
                _elsewhere(flag, ranks)
            _meet("test/after/model_call", ranks, rank)

    args = fz.hf.TrainingArguments(output_dir=os.path.join(out, "sample"), per_device_train_batch_size=2, max_steps=2,
                                   use_cpu=True, report_to=[], save_strategy="no", deepspeed=deepspeed(3),
                                   disable_tqdm=True)
    trainer = fz.hf.Trainer(model=llama(), args=args, train_dataset=causal_lm_data(), data_collator=collator("lm"),
                            callbacks=[Sample()])
    trainer.train()
    return said[0] if said else ("", 0.0)
