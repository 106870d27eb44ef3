"""A collator drawing from python's `random` and numpy's global generator: a run resumed from
checkpoint-N draws what transformers' own resumed run draws (transformers saves both generators
with torch's and sets them on resuming; fz's checkpoint holds them in each rank's data file),
and a damaged one is refused."""
from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest
import torch
import transformers

import fz.hf
from fz.errors import CheckpointError

from support import hf_pipeline as hp


class Noisy:
    """transformers' causal-LM collator, then each row's first tokens replaced where python's and
    numpy's generators say (as augmenting collators draw)."""

    def __init__(self):
        self.inner = hp.collator("lm")

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.inner(rows)
        ids = batch["input_ids"].clone()
        for r in range(ids.shape[0]):
            ids[r, 0] = 4 + random.randrange(50)
            ids[r, 1] = 4 + int(np.random.randint(50))
        batch["input_ids"], batch["labels"] = ids, ids.clone()
        return batch


def _run(on_fz: bool, out: str, resume: str | None, max_steps: int) -> list[float]:
    trainer_cls, args_cls = ((fz.hf.Trainer, fz.hf.TrainingArguments) if on_fz else
                             (transformers.Trainer, transformers.TrainingArguments))
    args = args_cls(output_dir=out, per_device_train_batch_size=4, max_steps=max_steps, learning_rate=3e-3,
                    logging_steps=1, use_cpu=True, report_to=[], save_strategy="steps", save_steps=2, seed=0,
                    disable_tqdm=True, train_sampling_strategy="sequential")
    t = trainer_cls(model=hp.llama(), args=args, train_dataset=hp.causal_lm_data(), data_collator=Noisy())
    random.seed(1)
    np.random.seed(1)
    t.train(resume_from_checkpoint=resume)
    random.seed(7)  # the next resume must not depend on where this run left them
    np.random.seed(7)
    torch.manual_seed(7)
    return [h["loss"] for h in t.state.log_history if "loss" in h]


def test_a_resumed_run_draws_what_transformers_resumed_run_draws(tmp_path):
    runs = {}
    for on_fz in (False, True):
        out = str(tmp_path / f"run{on_fz}")
        _run(on_fz, out, None, 4)
        runs[on_fz] = _run(on_fz, out, f"{out}/checkpoint-2", 4)
    assert runs[True] == pytest.approx(runs[False], rel=1e-5, abs=1e-7)
    data = tmp_path / "runTrue" / "checkpoint-2" / "fz" / "step_2" / "data_0.json"
    saved = json.loads(data.read_text())
    assert set(saved["data"]["generators"]) == {"python", "numpy"}


def test_damaged_generators_are_refused():
    from fz.hf.host_generators import captured, setter
    good = captured()
    setter(good, "here")()  # sets them back to where they are
    bad = json.loads(json.dumps(good))
    bad["numpy"][2] = 5000  # a position past the twister's 624 words
    with pytest.raises(CheckpointError, match="numpy's is not a Mersenne Twister state"):
        setter(bad, "here")
    bad = json.loads(json.dumps(good))
    bad["python"][1] = bad["python"][1][:10]
    with pytest.raises(CheckpointError, match="python's is not a Mersenne Twister state"):
        setter(bad, "here")
    for which in ("python", "numpy"):  # all zeros: random.random() returned 0.0, numpy 0, for ever
        bad = json.loads(json.dumps(good))
        words = bad[which][1]
        words[:624] = [0] * 624
        with pytest.raises(CheckpointError, match="a Mersenne Twister state of zeros, which draws nothing but zeros"):
            setter(bad, "here")
    bad = json.loads(json.dumps(good))
    bad["python"][2] = 1e308  # the next random.gauss()
    with pytest.raises(CheckpointError, match="a cached normal draw past 64"):
        setter(bad, "here")
    bad = json.loads(json.dumps(good))
    bad["numpy"][3], bad["numpy"][4] = 1, -1e308
    with pytest.raises(CheckpointError, match="a cached normal draw past 64"):
        setter(bad, "here")
    random.gauss(0, 1)  # a real cached draw passes
    np.random.standard_normal()
    setter(captured(), "here")
