"""`fz plan` says what it assumed and what it left out: the precision it starts at (bf16 for a GPU
plan unless told otherwise), what its estimates count (no activations without a batch shape),
and, when it picks activation checkpointing, a DeepSpeed section DeepSpeed accepts and what turns
checkpointing on there (Hugging Face's `gradient_checkpointing=True`)."""
from __future__ import annotations

import json
import re

import pytest
import torch

import fz
from fz.cli import main
from fz.planning import machine
from fz.planning.ladder import candidates
from fz.testing.gpt import GPT, GPTConfig, lm_loss

GB = 2**30
MODEL = "examples/train_gpt.py:default_model"
SMALL = GPTConfig(vocab=256, seq=128, dim=64, heads=2, layers=4)


def _plan(capsys, *args: str) -> str:
    assert main(["plan", "--model", MODEL, "--world-size", "1", *args]) == 0
    return capsys.readouterr().out


def _json(out: str) -> dict:
    return json.loads(re.search(r"^DeepSpeed config:\n(\{.*?^\})", out, re.S | re.M).group(1))


def test_a_gpu_plan_starts_at_bf16_and_says_so_unless_told(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(machine, "gpu_memory", lambda: None)  # the same on any machine
    gpu = _plan(capsys, "--device-gb", "24", "--host-gb", "64", "--nvme-path", str(tmp_path))
    assert "  precision: bf16 (the default for a GPU plan; --precision fp32 (precision='fp32') plans full " \
           "precision)" in gpu
    assert "spec = fz.Spec(precision='bf16')" in gpu and _json(gpu)["bf16"] == {"enabled": True}
    told = _plan(capsys, "--device-gb", "24", "--host-gb", "64", "--precision", "fp32", "--nvme-path", str(tmp_path))
    assert "  precision: fp32 (as given)" in told and "spec = fz.Spec()" in told
    assert _json(told)["bf16"] == {"enabled": False}
    # no --micro-batch: DeepSpeed refuses a config without a batch size, so the plan says what to add
    assert "train_micro_batch_size_per_gpu" not in _json(told) and '(it sets no batch size, as the plan was given ' \
        'none: add "train_micro_batch_size_per_gpu"' in told
    batched = _plan(capsys, "--device-gb", "24", "--host-gb", "64", "--micro-batch", "2", "--seq-len", "16",
                    "--nvme-path", str(tmp_path))
    assert _json(batched)["train_micro_batch_size_per_gpu"] == 2 and "it sets no batch size" not in batched
    cpu = _plan(capsys, "--nvme-path", str(tmp_path))  # no device budget, no GPU: the device is the host
    assert "  precision: fp32 (the default for a CPU plan; --precision bf16 (precision='bf16') plans mixed " \
           "precision)" in cpu
    spec = fz.plan(GPT(GPTConfig()), world_size=1, device_budget=24 * GB, host_budget=64 * GB,
                   nvme_path=str(tmp_path))
    assert spec.precision == "bf16"  # the function as the command
    assert fz.plan(GPT(GPTConfig()), spec=fz.Spec(precision="fp16"), world_size=1, device_budget=24 * GB,
                   host_budget=64 * GB, nvme_path=str(tmp_path)).precision == "fp16"  # the Spec's, when not fp32


def test_the_plan_says_what_it_counted_and_what_it_did_not(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(machine, "gpu_memory", lambda: None)
    without = _plan(capsys, "--device-gb", "24", "--host-gb", "64", "--nvme-path", str(tmp_path))
    assert "  counted: parameters, gradients, fp32 master weights, the optimizer's state" in without
    assert "  not counted: activations (no batch shape given: --micro-batch and --seq-len" in without
    assert "the CUDA context" in without  # a GPU plan
    traced = _plan(capsys, "--loss-fn", "examples/train_gpt.py:lm_loss", "--micro-batch", "8", "--seq-len", "129",
                   "--nvme-path", str(tmp_path))
    assert "and the activations of one traced micro-batch" in traced and "not counted: activations" not in traced
    assert "  not counted: the allocator's cached memory (the margin)" in traced  # a CPU plan: no CUDA context


def test_a_plan_that_checkpoints_says_what_turns_it_on_and_deepspeed_accepts_its_json(capsys, tmp_path):
    with torch.device("meta"):
        model = GPT(SMALL)
    base = fz.Spec(loss_fn=lm_loss)
    kw = dict(world_size=1, micro_batch=16, seq_len=129, nvme_path=str(tmp_path), disk_budget=2**40)
    found, _ = candidates(model, base=base, device_budget=GB, host_budget=16 * GB, stop_at_first=False, **kw)
    need = next(c.estimate.per_device for c in found if c.name == "+ activation checkpointing")
    assert need < found[0].estimate.per_device  # checkpointing is the first rung that fits the budget below
    spec = fz.plan(model, spec=base, device_budget=need / 0.8 * 1.001, host_budget=16 * GB, report=print, **kw)
    out = capsys.readouterr().out
    assert spec.activation_checkpointing is True and "chosen:\n  + activation checkpointing" in out
    section = _json(out)["activation_checkpointing"]
    # DeepSpeed's deepspeed.checkpointing.configure asserts partitioned activations under contiguous buffers
    assert not section["contiguous_memory_optimization"] or section["partition_activations"]
    assert section["number_checkpoints"] == SMALL.layers  # every block
    assert "does not turn it on. With Hugging Face's Trainer pass TrainingArguments(gradient_checkpointing=True)" in out
    back = fz.Spec.from_deepspeed(_json(out), world_size=1)
    assert back.activation_checkpointing is True and back.precision == spec.precision


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_ladder_has_a_bf16_rung_only_when_it_starts_below(precision, tmp_path):
    with torch.device("meta"):
        model = GPT(SMALL)
    found, _ = candidates(model, world_size=1, device_budget=GB, host_budget=GB, disk_budget=2**40,
                          nvme_path=str(tmp_path), stop_at_first=False, precision=precision)
    assert any(c.name == "+ bf16 mixed precision" for c in found) == (precision == "fp32")
    assert found[-1].spec.precision == "bf16"


def test_a_world_size_of_0_is_refused_not_planned_for_one_rank(capsys):
    assert main(["plan", "--params", "1e9", "--largest-layer", "1e8", "--world-size", "0"]) == 2
    assert "world_size=0 must be a positive multiple of nodes=1" in capsys.readouterr().err


@pytest.mark.parametrize("ref, said", [("nosuch:thing", "no module 'nosuch'"),
                                       ("fz.nosuch:thing", "no module 'fz.nosuch'"),
                                       ("fz.testing:NoSuch", "fz.testing has no 'NoSuch'")])
def test_a_mistyped_model_is_one_line_not_a_traceback(capsys, ref, said):
    assert main(["plan", "--model", ref, "--world-size", "1"]) == 2
    assert said in capsys.readouterr().err


def test_a_module_missing_what_it_imports_keeps_its_traceback(tmp_path, monkeypatch):
    """foo_bar.py exists and imports a missing `foo`: its own error, not "no module 'foo'" for --model."""
    (tmp_path / "foo_bar.py").write_text("import foo\n")  # a prefix of its name, not its package
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="No module named .foo.$"):
        main(["plan", "--model", "foo_bar:make", "--world-size", "1"])


def test_a_hugging_face_config_is_a_model_to_plan_for(tmp_path, capsys):
    """A DeepSpeed user estimating a Hub model had to write a factory: a config.json, or the model's folder,
    is one now (built by transformers from it, on meta)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2)
    config.save_pretrained(tmp_path)
    params = sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())
    for ref in (tmp_path / "config.json", tmp_path):
        assert main(["estimate", "--model", str(ref)]) == 0
        assert f"Model with {int(params / 1e6)}M total params" in capsys.readouterr().out  # DeepSpeed rounds down
