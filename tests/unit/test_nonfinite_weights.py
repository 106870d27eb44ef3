"""NaN or inf weights are named at load, by every loader: fz.init(weights=), fz.load_weights,
fz.restore and fz.import_deepspeed raise fz.NonFiniteError naming each tensor with its count
(fp32 and mixed precision alike: a value read into both the parameter and its fp32 master is
counted once); allow_nonfinite=True loads them with a warning that counts them. (At world 2:
tests/multirank/test_nonfinite_load.py.)"""
from __future__ import annotations

import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

import fz
from fz.ckpt.deepspeed.checkpoint import DeepSpeedCheckpoint

from support import ds_models as m
from support.ds_import_jobs import DATA, _spec

SAID = r"holds NaN or inf in 2 tensors \(4 values\): 'inp.weight' 3 of 128, 'out.bias' 1 of 1"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 1)


def _spec_of(precision: str) -> fz.Spec:
    return fz.Spec(stage=0, precision=precision, optimizer=fz.optim.adamw(lr=1e-2))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A from_pretrained-style folder: 3 NaNs in inp.weight, an inf in out.bias."""
    out = tmp_path_factory.mktemp("nan")
    sd = {k: v.clone() for k, v in Net().state_dict().items()}
    sd["inp.weight"].view(-1)[[0, 5, 77]] = math.nan
    sd["out.bias"][0] = -math.inf
    save_file(sd, out / "model.safetensors")
    return out


def _nans(state) -> int:
    return int(fz.full_params(state)["inp.weight"].isnan().sum())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_init_and_load_weights_name_them(folder, precision):
    with pytest.raises(fz.NonFiniteError, match=rf"fz.init: weights {folder} {SAID}\. Training from them would "
                                                r"skip every step; pass allow_nonfinite=True"):
        fz.init(Net(), _spec_of(precision), weights=folder)
    with pytest.warns(UserWarning, match=rf"fz.init: weights .* {SAID}\. Loaded as they are"):
        state = fz.init(Net(), _spec_of(precision), weights=folder, allow_nonfinite=True)
    assert _nans(state) == 3
    state = fz.init(Net(), _spec_of(precision))
    with pytest.raises(fz.NonFiniteError, match=rf"fz.load_weights: weights {folder} {SAID}"):
        fz.load_weights(state, folder)
    with pytest.warns(UserWarning, match=SAID):
        state = fz.load_weights(state, folder, allow_nonfinite=True)
    assert _nans(state) == 3


@pytest.mark.parametrize("precision, dtype, value", [("fp32", torch.float64, 1e300), ("fp16", torch.float32, 1e5)])
def test_a_value_that_overflows_the_states_dtype_is_named_as_the_inf_it_becomes(tmp_path, precision, dtype, value):
    """Finite in the file, inf once cast (an F64 1e300 into fp32, an F32 1e5 into fp16 parameters):
    counted after the cast, so it never reaches the weights."""
    sd = {k: v.to(dtype) for k, v in Net().state_dict().items()}
    sd["out.bias"].fill_(value)
    save_file(sd, tmp_path / "model.safetensors")
    said = r"holds NaN or inf in 1 tensors \(1 values\): 'out.bias' 1 of 1"
    with pytest.raises(fz.NonFiniteError, match=rf"fz.init: weights {tmp_path} {said}"):
        fz.init(Net(), _spec_of(precision), weights=tmp_path)
    with pytest.raises(fz.NonFiniteError, match=rf"fz.load_weights: weights {tmp_path} {said}"):
        fz.load_weights(fz.init(Net(), _spec_of(precision)), tmp_path)


def test_restore_names_them(folder, tmp_path):
    with pytest.warns(UserWarning):
        state = fz.init(Net(), _spec_of("bf16"), weights=folder, allow_nonfinite=True)
    fz.save(state, tmp_path / "ck", verbose=False)
    with pytest.raises(fz.NonFiniteError, match=rf"fz.restore: checkpoint .*step_0 {SAID}"):
        fz.restore(fz.init(Net(), _spec_of("bf16")), tmp_path / "ck", verbose=False)
    with pytest.warns(UserWarning, match=SAID):
        state = fz.restore(fz.init(Net(), _spec_of("bf16")), tmp_path / "ck", verbose=False, allow_nonfinite=True)
    assert _nans(state) == 3
    clean = fz.init(Net(), _spec_of("fp32"))  # a finite checkpoint restores without a word
    fz.save(clean, tmp_path / "clean", verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fz.restore(fz.init(Net(), _spec_of("fp32")), tmp_path / "clean", verbose=False)


def _poison(ck: Path, name: str, kind: str, element: int) -> None:
    """Write a NaN over one element of `name`'s stored `kind` (fp32 master or a moment) in place."""
    trainable = {n for n, p in m.TinyLM().named_parameters() if p.requires_grad} | {"head.weight"}  # places stage 0's
    piece = next(p for p in DeepSpeedCheckpoint(ck, trainable=trainable)._pieces_of(name, kind)
                 if p.start <= element < p.start + p.n)
    src = piece.src
    at = src.at + (src.offset + piece.src_start + element - piece.start) * src.dtype.itemsize
    with open(src.file, "r+b") as f:
        f.seek(at)
        f.write(torch.tensor([math.nan], dtype=src.dtype).view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("name", ["stage0_fp32", "stage3_bf16"])
def test_import_deepspeed_names_weights_and_moments(tmp_path, name):
    ck = tmp_path / "ck"
    shutil.copytree(DATA / name / "ckpt", ck)
    _poison(ck, "blocks.0.up.bias", "fp32", 0)
    _poison(ck, "blocks.1.down.bias", "exp_avg", 1)
    said = (r"holds NaN or inf in 2 tensors \(2 values\): 'blocks.0.up.bias' 1 of 35, 'blocks.1.down.bias' "
            r"exp_avg 1 of 12")
    with pytest.raises(fz.NonFiniteError, match=rf"fz.import_deepspeed: DeepSpeed checkpoint .*global_step3 {said}"):
        fz.import_deepspeed(fz.init(m.TinyLM(seed=1), _spec(0, "fp32", 1)), ck)
    with pytest.raises(fz.NonFiniteError, match=said):  # fz.restore of a DeepSpeed checkpoint imports it
        fz.restore(fz.init(m.TinyLM(seed=1), _spec(3, "fp32", 1)), ck)
    with pytest.warns(UserWarning, match=said):
        state, _ = fz.import_deepspeed(fz.init(m.TinyLM(seed=1), _spec(0, "fp32", 1)), ck, allow_nonfinite=True)
    assert math.isnan(float(fz.full_params(state)["blocks.0.up.bias"][0]))


def test_restore_and_import_count_a_master_past_the_parameters_range(tmp_path):
    """A finite fp32 master of 1e5 restored (or imported from DeepSpeed) into an fp16 state is inf in
    its fp16 parameter: named as such, never in the weights (fz.load_weights already counted so)."""
    state = fz.init(Net(), _spec_of("fp32"))
    fz.save(state, tmp_path / "ck", verbose=False)
    big = fz.init(Net(), _spec_of("fp32"))  # the same model, its out.bias past fp16's range
    with torch.no_grad():
        big.params["out.bias"]._local_tensor.fill_(1e5)
    fz.save(big, tmp_path / "big", verbose=False)
    said = r"holds NaN or inf in 1 tensors \(1 values\): 'out.bias' 1 of 1"
    with pytest.raises(fz.NonFiniteError, match=rf"fz.restore: checkpoint .*step_0 {said}"):
        fz.restore(fz.init(Net(), _spec_of("fp16")), tmp_path / "big", verbose=False)
    fz.restore(fz.init(Net(), _spec_of("fp16")), tmp_path / "ck", verbose=False)  # its own values fit
    ck = tmp_path / "ds"
    shutil.copytree(DATA / "stage0_fp32" / "ckpt", ck)
    piece = next(iter(DeepSpeedCheckpoint(ck, trainable={n for n, p in m.TinyLM().named_parameters()}
                                          | {"head.weight"})._pieces_of("blocks.0.up.bias", "fp32")))
    src = piece.src
    with open(src.file, "r+b") as f:
        f.seek(src.at + (src.offset + piece.src_start) * src.dtype.itemsize)
        f.write(torch.tensor([1e5], dtype=src.dtype).view(torch.uint8).numpy().tobytes())
    with pytest.raises(fz.NonFiniteError, match=r"holds NaN or inf in 1 tensors \(1 values\): 'blocks.0.up.bias' 1"):
        fz.import_deepspeed(fz.init(m.TinyLM(seed=1), _spec(0, "fp32", 1).replace(precision="fp16")), ck)


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 4)
        self.bn = nn.BatchNorm1d(4)


@pytest.mark.parametrize("poison", ["nan", "overflow", "float count"])
def test_a_buffers_values_are_checked_as_the_weights_are(tmp_path, poison):
    """NaN in BatchNorm's running_var (every output NaN), a 1e300 running_mean (inf in fp32) and a float
    NaN for the int64 num_batches_tracked (-2**63) loaded silently: buffers were not counted."""
    sd = {k: v.clone() for k, v in Normed().state_dict().items()}
    if poison == "nan":
        sd["bn.running_var"][1] = math.nan
    elif poison == "overflow":
        sd["bn.running_mean"] = sd["bn.running_mean"].double().fill_(1e300)
    else:
        sd["bn.num_batches_tracked"] = torch.tensor(math.nan)
    save_file(sd, tmp_path / "model.safetensors")
    if poison == "float count":
        with pytest.raises(fz.CheckpointError, match=r"'bn.num_batches_tracked' is torch.float32 in the file, "
                                                      r"torch.int64 here"):
            fz.init(Normed(), _spec_of("fp32"), weights=tmp_path)
        return
    name, n = ("bn.running_var", 1) if poison == "nan" else ("bn.running_mean", 4)
    with pytest.raises(fz.NonFiniteError, match=rf"holds NaN or inf in 1 tensors \({n} values\): buffer '{name}' "
                                                rf"{n} of 4"):
        fz.init(Normed(), _spec_of("fp32"), weights=tmp_path)
    with pytest.warns(UserWarning, match=rf"buffer '{name}' {n} of 4"):
        fz.init(Normed(), _spec_of("fp32"), weights=tmp_path, allow_nonfinite=True)
    sd[name].fill_(-math.inf)  # a mask's -inf is kept
    save_file(sd, tmp_path / "model.safetensors")
    fz.init(Normed(), _spec_of("fp32"), weights=tmp_path)
