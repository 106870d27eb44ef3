"""Every file fz writes into a folder others may write to (an export's output, a DeepSpeed
output_dir, a monitor's log folder) is made anew: a symlink planted under the name it writes, or
under its staging name, is replaced or removed, never written through (fz/storage/fresh.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fz
import fz.deepspeed as deepspeed
from fz.ckpt import consolidate
from fz.deepspeed.utils import zero_to_fp32
from fz.observe.writers import CsvWriter
from fz.storage.fresh import fresh_dir, open_fresh, replacing

from support.helpers import make_model, spec

DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed"
MINE = "IMPORTANT USER DATA\n"


@pytest.fixture
def victim(tmp_path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text(MINE)
    return path


def _plant(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)


def test_the_helpers_never_follow_a_link(tmp_path, victim):
    _plant(tmp_path / "a", victim)
    with open_fresh(tmp_path / "a", "w") as f:
        f.write("new")
    _plant(tmp_path / "b", victim)
    with replacing(tmp_path / "b") as tmp:
        tmp.write_text("new")
    _plant(tmp_path / "c", tmp_path)
    fresh_dir(tmp_path / "c")
    assert victim.read_text() == MINE
    assert [(tmp_path / n).is_symlink() for n in "abc"] == [False] * 3
    assert (tmp_path / "a").read_text() == (tmp_path / "b").read_text() == "new" and (tmp_path / "c").is_dir()
    with pytest.raises(RuntimeError), replacing(tmp_path / "d") as tmp:  # a failed write leaves nothing
        tmp.write_text("half")
        raise RuntimeError
    assert not (tmp_path / "d").exists() and not list(tmp_path.glob(".d.*"))
    old = os.umask(0o077)  # the file is made as open() makes it: the umask applies
    try:
        with replacing(tmp_path / "e") as tmp:
            tmp.write_text("private")
    finally:
        os.umask(old)
    assert (tmp_path / "e").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("hf", [False, True])
def test_consolidate_writes_no_planted_link(tmp_path, victim, hf):
    state = fz.init(make_model(), spec(0, 1))
    fz.save(state, tmp_path / "ck", verbose=False)
    (tmp_path / "ck" / "config.json").write_text('{"model_type": "test"}')
    out = tmp_path / "out"
    if hf:  # the copied config, and the staging folder
        _plant(out / "config.json", victim)
        _plant(out / f".fz-consolidate-{os.getpid()}", victim.parent)
        consolidate(tmp_path / "ck", out, hf=True)
        assert json.loads((out / "config.json").read_text()) == {"model_type": "test"}
        weights = out / "model.safetensors"
    else:
        weights = out / "m.safetensors"
        _plant(out / "m.safetensors.tmp", victim)
        consolidate(tmp_path / "ck", weights, progress=False)
    assert victim.read_text() == MINE and not weights.is_symlink()
    assert set(load_file(weights)) <= set(fz.full_params(state))


def test_deepspeeds_writers_replace_a_planted_link(tmp_path, victim):
    """save_16bit_model's file, zero_to_fp32's files and the csv monitor's scalars."""
    model = torch.nn.Linear(4, 2)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.backward(engine(torch.ones(2, 4)).square().mean())
    engine.step()
    _plant(tmp_path / "out16" / "pytorch_model.bin", victim)
    assert engine.save_16bit_model(tmp_path / "out16")
    _plant(tmp_path / "fp32" / "model.safetensors", victim)
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(DATA / "stage3_fp32" / "ckpt", tmp_path / "fp32",
                                                            safe_serialization=True)
    _plant(tmp_path / "logs" / "scalars.csv", victim)
    CsvWriter(tmp_path / "logs").close()
    assert victim.read_text() == MINE
    assert set(torch.load(tmp_path / "out16" / "pytorch_model.bin", weights_only=True)) == {"weight", "bias"}
    assert load_file(tmp_path / "fp32" / "model.safetensors")
    assert (tmp_path / "logs" / "scalars.csv").read_text().startswith("step,tag,value")
