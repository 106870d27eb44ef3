"""DeepSpeedCheckpoint and `fz consolidate` against checkpoints real DeepSpeed 0.19.8 wrote.

tests/data/deepspeed/<name>/ (made by tests/support/make_ds_checkpoints.py) holds each
checkpoint, DeepSpeed's own zero_to_fp32 output of it and the live engine's full fp32 masters
and Adam moments at the save: every value fz reads must equal them exactly. The `_groups`
fixtures were trained with Hugging Face's two parameter groups (weight decay, and none for biases
and norms), which a stage-0 file lists unnamed and interleaved.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fz.ckpt.deepspeed import checkpoint as ds_checkpoint
from fz.ckpt.deepspeed.checkpoint import DeepSpeedCheckpoint
from fz.ckpt.export import consolidate
from fz.errors import CheckpointError

from support import ds_models as m

DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed"
NAMES = sorted(p.name for p in DATA.iterdir() if (p / "record.json").is_file())
PARAMS = ["embed.weight", "blocks.0.norm.weight", "blocks.0.norm.bias", "blocks.0.up.weight", "blocks.0.up.bias",
          "blocks.0.down.weight", "blocks.0.down.bias", "blocks.1.norm.weight", "blocks.1.norm.bias",
          "blocks.1.up.weight", "blocks.1.up.bias", "blocks.1.down.weight", "blocks.1.down.bias"]


# the trainable names, as a target model gives them to place a stage-0 file's unnamed parameters (tied alias too)
TRAINABLE = frozenset(PARAMS) | {"head.weight"}


def _params(name: str) -> list[str]:
    """The order DeepSpeed lists them in: group after group (ds_models.param_groups)."""
    if not _record(name).get("grouped"):
        return PARAMS
    no_decay = [n for n in PARAMS if n.endswith(m.NO_DECAY)]
    return [n for n in PARAMS if n not in no_decay] + no_decay


def _open(name: str) -> DeepSpeedCheckpoint:
    return DeepSpeedCheckpoint(DATA / name / "ckpt", trainable=TRAINABLE)


def full(ck: DeepSpeedCheckpoint, name: str, kind: str = "fp32") -> torch.Tensor:
    real = ck.shared.get(name, name)
    shape = ck.params.get(real) or ck.frozen[real]
    out = torch.full((math.prod(shape),), float("nan"))
    for at, chunk in ck.read(name, kind):
        assert chunk.dtype == torch.float32 and chunk.dim() == 1
        out[at:at + chunk.numel()] = chunk
    return out.view(shape)


def _record(name: str) -> dict:
    return json.loads((DATA / name / "record.json").read_text())


@pytest.mark.parametrize("name", NAMES)
def test_fields(name: str) -> None:
    rec = _record(name)
    with _open(name) as ck:
        assert (ck.stage, ck.precision, ck.world) == (rec["stage"], rec["precision"], rec["world"])
        assert ck.tag == "global_step3" and ck.path == DATA / name / "ckpt" / "global_step3"
        assert (ck.global_steps, ck.global_samples, ck.skipped_steps) == (3, 12, 0)
        # DeepSpeed's unfused bf16 optimizer (stage 0) steps once more, at its setup
        assert ck.optimizer_step == (4 if name == "stage0_bf16" else 3)
        # what DeepSpeed's load_checkpoint returns: the client's keys and the fields of its file it does not load
        assert {k: ck.client_state[k] for k in ("step", "note")} == rec["client_state"] == {"step": 3, "note": "x"}
        assert ck.client_state["ds_config"] == rec["config"] and ck.client_state["global_samples"] == 12
        assert set(ck.client_state) == {"step", "note", "buffer_names", "param_shapes", "frozen_param_shapes",
                                        "shared_params", "frozen_param_fragments", "global_samples",
                                        "checkpoint_parallel_dimensions", "ds_config", "ds_version"}
        assert ck.lr_scheduler == {"last_batch_iteration": 2}
        assert ck.ds_config == rec["config"]
        assert list(ck.params) == _params(name)
        assert ck.frozen == {"frozen.weight": (12, 12), "frozen.bias": (12,)}
        assert ck.shared == {"head.weight": "embed.weight"}
        assert list(ck.buffers) == ["scale"] and torch.equal(ck.buffers["scale"], torch.linspace(0.5, 1.5, 12))
        assert ck.moments == ("exp_avg", "exp_avg_sq")
        assert ck.loss_scale is None


@pytest.mark.parametrize("name", ["stage3_fp32", "stage0_bf16"])
def test_fz_inspect_shows_what_deepspeeds_files_hold(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """It said `latest` "is corrupted" (not fz's format) of a checkpoint consolidate and restore read."""
    from fz.cli import main
    rec = _record(name)
    assert main(["inspect", str(DATA / name / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "global_step3 (DeepSpeed's own files)" in out and "step           3" in out, out
    assert f"world size     {rec['world']}" in out and f"ZeRO stage     {rec['stage']}" in out, out
    assert f"precision      {rec['precision']}" in out and "manifest       none (DeepSpeed writes none)" in out, out
    assert main(["inspect", str(DATA / name / "ckpt" / "global_step3"), "--step", "3"]) == 0  # the tag folder too


@pytest.mark.parametrize("name", NAMES)
def test_values_equal_deepspeed(name: str) -> None:
    """Masters and moments equal the live engine's; params, frozen params and aliases equal zero_to_fp32's."""
    engine = load_file(DATA / name / "engine.safetensors")
    assert len(engine) == 3 * len(PARAMS)
    with _open(name) as ck:
        for key, want in engine.items():
            kind, param = key.split("/", 1)
            assert torch.equal(full(ck, param, kind), want), key
        z2f = DATA / name / "zero_to_fp32.safetensors"
        if z2f.exists():
            for key, want in load_file(z2f).items():
                got = ck.buffers[key] if key in ck.buffers else full(ck, key)
                assert torch.equal(got, want), key
        assert torch.equal(full(ck, "head.weight"), full(ck, "embed.weight"))


@pytest.mark.parametrize("stage", [2, 3])
def test_universal_equals_its_source(stage: int) -> None:
    """ds_to_universal's zero/<name>/*.pt hold what the checkpoint it came from holds. From ZeRO-3
    Adam's step is only in zero/optimizer_state.pt (no step.pt): it was read as none, and an import
    restarted Adam's bias correction at step 0; its frozen weights are in each rank's model file."""
    src = DeepSpeedCheckpoint(DATA / f"stage{stage}_fp32" / "ckpt")
    uni = DeepSpeedCheckpoint(DATA / f"stage{stage}_fp32" / "universal")
    assert (uni.stage, uni.world, uni.optimizer_step, uni.moments) == (stage, 2, 3, src.moments)
    assert uni.loss_scaler == src.loss_scaler
    assert (uni.params, uni.frozen, uni.shared) == (src.params, src.frozen, src.shared)
    for name in [*src.params, *src.frozen]:
        for kind in ("fp32", *(src.moments if name in src.params else ())):
            assert torch.equal(full(uni, name, kind), full(src, name, kind)), (name, kind)


def test_slices_and_small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slice [lo, hi) across the ranks' boundary, read in chunks of 3 elements."""
    monkeypatch.setattr(ds_checkpoint, "CHUNK_BYTES", 12)
    ck = DeepSpeedCheckpoint(DATA / "stage3_fp32" / "ckpt")
    whole = full(ck, "blocks.0.up.weight", "exp_avg").view(-1)
    got = list(ck.read("blocks.0.up.weight", "exp_avg", 200, 230))
    assert all(c.numel() <= 3 for _, c in got) and got[0][0] == 200
    assert torch.equal(torch.cat([c for _, c in got]), whole[200:230])
    with pytest.raises(CheckpointError, match="has 420 elements"):
        next(ck.read("blocks.0.up.weight", lo=0, hi=421))
    with pytest.raises(CheckpointError, match="no 'exp_avg' for 'frozen.weight'"):
        next(ck.read("frozen.weight", "exp_avg"))
    with pytest.raises(CheckpointError, match="no parameter 'nope'"):
        next(ck.read("nope"))


@pytest.mark.parametrize("name", NAMES)
def test_consolidate_equals_zero_to_fp32(name: str, tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    info = consolidate(DATA / name / "ckpt", out)
    got = load_file(out)
    z2f = DATA / name / "zero_to_fp32.safetensors"
    want = load_file(z2f) if z2f.exists() else {}
    assert info.tensors == len(got) == 17  # 13 params, 2 frozen, 1 buffer, 1 tied alias
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    engine = load_file(DATA / name / "engine.safetensors")
    for key in PARAMS:
        assert torch.equal(got[key], engine[f"fp32/{key}"])
    hf = tmp_path / "hf"
    consolidate(DATA / name / "ckpt" / "global_step3", hf, hf=True, dtype="bf16", max_shard_size=4000)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got)
    shards = {k: v for f in set(index["weight_map"].values()) for k, v in load_file(hf / f).items()}
    assert all(torch.equal(shards[k], got[k].to(torch.bfloat16)) for k in got)


def _copy(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}"
    shutil.copytree(DATA / name / "ckpt", dst)
    return dst


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        DeepSpeedCheckpoint(tmp_path / "none")
    with pytest.raises(CheckpointError, match=r"tag 'global_step9' not found .*tags there: global_step3"):
        DeepSpeedCheckpoint(DATA / "stage2_fp32" / "ckpt", tag="global_step9")
    d = _copy(tmp_path, "stage2_fp32")
    (d / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match="missing zero_pp_rank_1_mp_rank_00_optim_states.pt .*2 ranks"):
        DeepSpeedCheckpoint(d)
    d = _copy(tmp_path, "stage3_fp32")
    (d / "global_step3" / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match="missing zero_pp_rank_1_mp_rank_00_model_states.pt"):
        DeepSpeedCheckpoint(d)
    d = _copy(tmp_path, "stage1_fp32")
    shutil.copy(d / "global_step3" / "mp_rank_00_model_states.pt", d / "global_step3" / "mp_rank_01_model_states.pt")
    with pytest.raises(CheckpointError, match="model-parallel .*mp_rank_01_model_states.pt.*not supported"):
        DeepSpeedCheckpoint(d)
    d = _copy(tmp_path, "stage0_fp32")
    (d / "global_step3" / "layer_01-model_00-model_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="pipeline-parallel .*not supported"):
        DeepSpeedCheckpoint(d)
    d = _copy(tmp_path, "stage1_fp32")
    f = d / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[:3000])
    with pytest.raises(CheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        ck = DeepSpeedCheckpoint(d)
        [list(ck.read(n)) for n in ck.params]
    with pytest.raises(CheckpointError, match="never signed"):
        consolidate(DATA / "stage1_fp32" / "ckpt", tmp_path / "o.safetensors", key=b"k" * 32)


@pytest.mark.skipif(not os.environ.get("FZ_DEEPSPEED_PYTHON"),
                    reason="set FZ_DEEPSPEED_PYTHON to a python with deepspeed to regenerate a checkpoint live")
def test_live_deepspeed(tmp_path: Path) -> None:
    """Real DeepSpeed writes a fresh stage-3 bf16 checkpoint; fz reads what zero_to_fp32 reads."""
    root = Path(__file__).resolve().parents[2]
    code = ("import sys; from pathlib import Path; from tests.support import make_ds_checkpoints as m; "
            "m.make('stage3_bf16', Path(sys.argv[1]))")
    subprocess.run([os.environ["FZ_DEEPSPEED_PYTHON"], "-c", code, str(tmp_path)], check=True, timeout=600,
                   cwd=root, env=dict(os.environ, PYTHONPATH=str(root), DS_ACCELERATOR="cpu"),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ck = DeepSpeedCheckpoint(tmp_path / "stage3_bf16" / "ckpt")
    for key, want in load_file(tmp_path / "stage3_bf16" / "zero_to_fp32.safetensors").items():
        assert torch.equal(ck.buffers[key] if key in ck.buffers else full(ck, key), want), key
