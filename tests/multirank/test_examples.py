"""Every example runs in its short CI mode under torchrun (2 processes) and its loss falls;
train_gpt's resume from a mid-run checkpoint gives bit-identical losses (data position included)."""
from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the slow tier: .ci/run runs it (-m slow)

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(k, None)


def torchrun(cwd: Path, example: str, *args: str, procs: int = 2, timeout: float = 300) -> str:
    """The example under torchrun with `procs` processes (1: plain `python example.py`)."""
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)] if procs > 1 else []
    cmd = [sys.executable, *launch, str(REPO / "examples" / example), *args]
    out = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{example} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def falls(out: str) -> tuple:
    first, last = map(float, re.search(r"^loss ([\d.]+) -> ([\d.]+)", out, re.M).groups())
    assert last < 0.9 * first, out[-2000:]
    return first, last


def _losses(root: Path) -> dict:
    (path,) = root.glob("*/scalars.csv")
    return {int(r["step"]): float(r["value"]) for r in csv.DictReader(open(path)) if r["tag"] == "train/loss"}


def test_train_gpt_trains_saves_and_resumes_bit_identically(tmp_path):
    common = ("--ci", "--log-every", "1", "--logdir", "", "--eval-every", "10")
    whole = torchrun(tmp_path, "train_gpt.py", *common, "--save-every", "15", "--csv", "a")
    falls(whole)
    assert re.search(r"^step 30  eval/loss \d", whole, re.M) and "fz: saved checkpoints/train_gpt/step_15" in whole
    resumed = torchrun(tmp_path, "train_gpt.py", *common, "--resume", "15", "--csv", "b")
    assert "fz: restored checkpoints/train_gpt/step_15" in resumed and "over steps 16-30" in resumed
    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert sorted(b) == list(range(16, 31)) and all(b[s] == a[s] for s in b), (a, b)


def test_train_gpt_from_a_deepspeed_config(tmp_path):
    out = torchrun(
        tmp_path,
        "train_gpt.py",
        "--ci",
        "--steps",
        "12",
        "--deepspeed",
        str(REPO / "examples/ds_config.json"),
        "--eval-every",
        "0",
        "--offload",
        "cpu",
        procs=1,
    )
    assert re.search(r"^stage +config +zero_optimization\.stage +3$", out, re.M)
    assert re.search(r"^grad_accum +config +train_batch_size / \(train_micro_batch_size_per_gpu \* world_size\) +4$",
                     out, re.M)  # 32 / (8 * 1 process)
    assert re.search(r"^ +host: .*moments [1-9]", out, re.M)  # --offload cpu: Adam's moments in host memory
    falls(out)


def test_your_model_trains_resumes_and_exports(tmp_path):
    out = torchrun(tmp_path, "your_model.py", "--ci")
    falls(out)
    exported = float(re.search(r"exported model's held-out loss: ([\d.]+)", out).group(1))
    assert exported < 0.5 and (tmp_path / "your_model.safetensors").exists()
    again = torchrun(tmp_path, "your_model.py", "--ci", procs=1)  # resumes at step 40 on 1 process: nothing left
    assert "fz: restored checkpoints/your_model/step_40" in again and "nothing left to train" in again
    assert f"held-out loss: {exported:.4f}" in again


def test_finetune_frozen_trains_the_adapter_only(tmp_path):
    out = torchrun(tmp_path, "finetune_frozen.py", "--ci")
    falls(out)
    assert "frozen trunk unchanged: True" in out and "missing: adapter.down" in out
    used, every = (int(x.replace(",", "")) for x in re.search(
        r"optimizer state on this rank ([\d,]+) bytes \(Adam for every parameter would be ([\d,]+)\)", out).groups())
    assert used < every / 20


def test_hf_causal_lm_exports_weights_from_pretrained_loads(tmp_path):
    pytest.importorskip("transformers")
    out = torchrun(tmp_path, "hf_causal_lm.py", "--ci")
    falls(out)
    assert "from_pretrained: same logits as fz" in out


def test_hf_trainer_script_runs_under_fz_run_with_transformers_own_zero3_config(tmp_path):
    """examples/hf_trainer.py (HfArgumentParser, `--deepspeed` with transformers' ds_config_zero3.json:
    ZeRO-3 with CPU offload of parameters and optimizer, "auto" everywhere) under `fz run
    --num_gpus 2`; its save_model folder loads with from_pretrained and gives the eval loss it printed."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import torch
    from transformers import GPT2LMHeadModel
    out_dir = tmp_path / "out"
    cmd = [sys.executable, "-m", "fz", "run", "--num_gpus", "2", str(REPO / "examples" / "hf_trainer.py"),
           "--deepspeed", str(REPO / "tests" / "data" / "ds_config_zero3.json"), "--output_dir", str(out_dir),
           "--max_steps", "8", "--per_device_train_batch_size", "4", "--learning_rate", "3e-3", "--logging_steps", "4",
           "--use_cpu", "--report_to", "none", "--disable_tqdm", "true"]
    run = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    printed = float(re.search(r"^eval_loss ([\d.]+)", run.stdout, re.M).group(1))
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from hf_trainer import Windows
    finally:
        sys.path.pop(0)
    model = GPT2LMHeadModel.from_pretrained(out_dir).eval()
    rows = Windows(64, slice(-32, None)).rows
    with torch.no_grad():
        assert model(input_ids=rows, labels=rows).loss.item() == pytest.approx(printed, abs=1e-4)


def test_deepspeed_engine_script_trains_saves_and_resumes_under_fz_run(tmp_path):
    """examples/deepspeed_engine.py (seed 003: `import fz.deepspeed as deepspeed`, argparse with
    add_config_arguments, save_checkpoint with client_sd, load_checkpoint and dataloader_to_step)
    under `fz run --num_gpus 2 ... --deepspeed --deepspeed_config`: the engine logs every
    steps_per_print updates as DeepSpeed does; its checkpoint resumes where the script left off."""
    def launch(*args: str) -> str:
        cmd = [sys.executable, "-m", "fz", "run", "--num_gpus", "2", str(REPO / "examples" / "deepspeed_engine.py"),
               "--deepspeed", "--deepspeed_config", str(REPO / "examples" / "ds_config.json"), *args]
        run = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
        return run.stdout + run.stderr

    first = launch("--save_dir", "ckpt", "--steps", "20", "--save_interval", "10")
    losses = {int(s): float(v) for s, v in re.findall(r"^step (\d+)\s+loss ([\d.]+)", first, re.M)}
    assert sorted(losses) == [10, 20] and losses[20] < 0.8 * losses[10], first[-2000:]
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step20"
    # the script's own resume (load_checkpoint, client_sd["step"]), here in one process: its rows
    # per rank and updates are the two ranks' (a checkpoint restores at any world size)
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import deepspeed_engine as example
    finally:
        sys.path.pop(0)
    import json

    import fz.deepspeed as deepspeed
    cfg = json.loads((REPO / "examples" / "ds_config.json").read_text())
    cfg.pop("tensorboard")  # this process writes no event files into the test's working directory
    engine, *_ = deepspeed.initialize(model=example.TinyLM(), config={**cfg, "train_batch_size": 16})
    _, client_sd = engine.load_checkpoint(str(tmp_path / "ckpt"))
    assert client_sd["step"] == 20 and engine.global_steps == 20  # the script's key, beside DeepSpeed's fields
    assert client_sd["global_samples"] == engine.global_samples and client_sd["ds_version"] == deepspeed.__version__
