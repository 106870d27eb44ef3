"""`deepspeed.utils` and `deepspeed.accelerator` on fz (scripts failed on `deepspeed.utils.log_dist`,
`zero_to_fp32` and `get_accelerator()` with an AttributeError): zero_to_fp32's state_dict equals
DeepSpeed 0.19.8's own output for the checkpoints it wrote (tests/data/deepspeed), and reads the
checkpoints fz.deepspeed's save_checkpoint writes, which DeepSpeed's cannot; log_dist logs where
DeepSpeed's does; the CPU accelerator answers as DeepSpeed's CPU accelerator (live, with
FZ_DEEPSPEED_PYTHON)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fz.deepspeed as deepspeed
from fz.deepspeed.utils import zero_to_fp32

DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed"
WRITTEN = sorted(p.name for p in DATA.iterdir() if (p / "zero_to_fp32.safetensors").exists())


@pytest.mark.parametrize("name", WRITTEN)
def test_the_state_dict_is_deepspeeds_zero_to_fp32s(name):
    got = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(DATA / name / "ckpt")
    want = load_file(DATA / name / "zero_to_fp32.safetensors")
    assert set(want) <= set(got)  # ZeRO 1's frozen parameters too, which DeepSpeed's leaves out
    assert set(got) - set(want) <= {"frozen.weight", "frozen.bias"}
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


def test_a_tag_frozen_parameters_left_out_and_the_folder_written_as_deepspeed_writes_it(tmp_path):
    ckpt = DATA / "stage3_fp32" / "ckpt"
    tag = (ckpt / "latest").read_text().strip()
    whole = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt, tag=tag)
    trained = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt, exclude_frozen_parameters=True)
    assert set(whole) - set(trained) == {"frozen.weight", "frozen.bias"}
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "one", safe_serialization=True)
    one = load_file(tmp_path / "one" / "model.safetensors")
    assert sorted(one) == sorted(whole) and all(torch.equal(one[k], whole[k]) for k in whole)
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "bins", max_shard_size=1000)
    index = json.loads((tmp_path / "bins" / "pytorch_model.bin.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0].startswith("pytorch_model-00001-of-")
    parts = {k: v for f in files for k, v in torch.load(tmp_path / "bins" / f, weights_only=True).items()}
    assert sorted(parts) == sorted(index["weight_map"]) == sorted(whole)
    assert all(torch.equal(parts[k], whole[k]) for k in whole)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_checkpoint_fz_deepspeed_saved_reads_back_as_the_engines_weights(tmp_path, stage):
    """Every name of the model's state_dict, a tied alias too (a strict load_state_dict failed on
    it), and exclude_frozen_parameters leaves the frozen ones out (it was ignored), as DeepSpeed's."""
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
              "zero_optimization": {"stage": stage}}
    def tied():
        torch.manual_seed(0)
        lin = torch.nn.Linear
        model = torch.nn.Sequential(lin(6, 6), torch.nn.Tanh(), lin(6, 6), lin(6, 6))
        model[3].weight = model[2].weight
        return model
    model = tied()
    model[0].requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    engine.backward(engine(torch.randn(4, 6)).square().mean())
    engine.step()
    engine.save_checkpoint(tmp_path)
    got = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    want = engine.module_state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k].float()) for k in want)
    tied().load_state_dict(got)  # strict
    trained = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(tmp_path, exclude_frozen_parameters=True)
    assert sorted(got) == sorted([*trained, "0.weight", "0.bias"])
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(tmp_path, tmp_path / "st", safe_serialization=True)
    tied().load_state_dict(load_file(tmp_path / "st" / "model.safetensors"))  # the alias a copy: safetensors takes it
    if stage == 3:  # DeepSpeed's recipe: the scripts it copies beside its checkpoints, run as a user runs them
        for script, extra, dtype in (("zero_to_fp32.py", [], torch.float32),
                                     ("zero_to_torch.py", ["--dtype", "bf16"], torch.bfloat16)):
            out = tmp_path / f"out_{dtype}"
            subprocess.run([sys.executable, str(tmp_path / script), str(tmp_path), str(out), "--safe_serialization",
                            *extra], check=True, timeout=120, cwd=tmp_path, capture_output=True)
            written = load_file(out / "model.safetensors")
            assert sorted(written) == sorted(got)
            assert all(torch.equal(written[k], got[k].to(dtype)) for k in got)
        zero_to_fp32.convert_zero_checkpoint_to_state_dict(tmp_path, tmp_path / "named", "torch.float16",
                                                           safe_serialization=True)  # DeepSpeed's spelling too
        assert load_file(tmp_path / "named" / "model.safetensors")["2.weight"].dtype == torch.float16


def test_log_dist_logs_on_the_ranks_deepspeeds_does(caplog):
    """Listed ranks (or [-1]) log, prefixed; with no process group every process logs, as rank -1."""
    import torch.distributed as dist
    up = dist.is_initialized()
    me = dist.get_rank() if up else -1
    with caplog.at_level(logging.INFO, logger="DeepSpeed"):
        for ranks in ([me], [-1], [me + 1], None):
            deepspeed.utils.log_dist(f"to {ranks}", ranks=ranks)
    want = [f"[Rank {me}] to {r}" for r in ([me], [-1], [me + 1], None) if not up or r in ([me], [-1])]
    assert [r.getMessage() for r in caplog.records] == want
    assert deepspeed.utils.logger.name == "DeepSpeed"


PROBE = ("a = get_accelerator(); import torch; print(repr([a.device_name(), a.device_name(0), a.current_device(), "
         "a.current_device_name(), a.device_count(), a.is_available(), a.is_bf16_supported(), "
         "bool(a.is_fp16_supported()), a.communication_backend_name(), a.supported_dtypes(), "
         "a.on_accelerator(torch.ones(1)), a.total_memory() > 0, a.memory_allocated() > 0]))")


def test_the_cpu_accelerator_answers_as_deepspeeds():
    from fz.deepspeed.accelerator import get_accelerator
    a = get_accelerator()
    assert a is deepspeed.accelerator.get_accelerator()
    ours = eval(PROBE.split("; ", 2)[2].replace("print(repr(", "(")[:-1])  # noqa: S307 - the probe's list
    assert ours == ["cpu", "cpu", 0, "cpu", 1, True, True, False, "gloo", [torch.float32, torch.bfloat16], True,
                    True, True]
    assert a.max_memory_allocated() >= a.memory_allocated() > 0
    if os.environ.get("FZ_DEEPSPEED_PYTHON"):
        code = "from deepspeed.accelerator import get_accelerator; " + PROBE
        out = subprocess.run([os.environ["FZ_DEEPSPEED_PYTHON"], "-c", code], capture_output=True, text=True,
                             check=True, timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"}).stdout
        assert out.strip().splitlines()[-1] == repr(ours)
