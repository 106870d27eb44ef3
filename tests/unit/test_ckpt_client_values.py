"""What a script's client state holds besides JSON and tensors, as DeepSpeed's save_checkpoint
(which pickles it) keeps it: an argparse.Namespace (Megatron-style `{"args": args}`) and numpy
arrays and scalars come back equal and of their type, rebuilt as data (nothing run); a crafted
file's reference to a tensor that is not its own is refused."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

import fz
import fz.deepspeed as deepspeed
from fz.ckpt import manifest
from fz.ckpt.tree import decode, encode
from fz.errors import CheckpointError

from support.helpers import make_model, spec

CLIENT = {"args": argparse.Namespace(lr=0.1, name="x", layers=[1, 2], inner=argparse.Namespace(a=1)),
          "table": np.arange(6.0).reshape(2, 3), "best": np.float64(0.5), "count": np.int32(7),
          "flags": np.array([True, False]), "plain": {"epoch": 3, "loss": 1.5}}


def same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    assert got["args"] == want["args"] and got["plain"] == want["plain"]
    for k in ("table", "flags", "best", "count"):
        assert type(got[k]) is type(want[k]) and got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k])


def test_fz_save_keeps_namespaces_and_numpy_values(tmp_path):
    state = fz.init(make_model(), spec(0, 1))
    fz.save(state, tmp_path, client_state=CLIENT)
    _, got = fz.restore(fz.init(make_model(), spec(0, 1)), tmp_path, with_client_state=True)
    same(got, CLIENT)


def test_the_deepspeed_engine_keeps_them_as_deepspeed_does(tmp_path):
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=torch.nn.Linear(4, 2), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 2}})
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    engine.save_checkpoint(tmp_path, client_state=CLIENT)
    _, got = engine.load_checkpoint(tmp_path)
    same({k: got[k] for k in CLIENT}, CLIENT)


def test_an_object_array_is_refused_and_a_crafted_reference_too():
    with pytest.raises(fz.ConfigError, match="ndarray is neither JSON-able nor a tensor"):
        encode({"x": np.array([object()])}, "client")
    tree, tensors = encode({"x": np.arange(3)}, "client")
    assert json.loads(json.dumps(tree)) == {"x": {"__fz_ndarray__": "client/x"}}
    assert np.array_equal(decode(tree, tensors)["x"], np.arange(3))


@pytest.mark.parametrize("mark", ["__fz_ndarray__", "__fz_npscalar__"])
def test_a_file_referring_to_a_weight_as_an_array_is_refused(tmp_path, mark):
    state = fz.init(make_model(), spec(0, 1))
    fz.save(state, tmp_path, client_state={"x": np.arange(3)})
    step = tmp_path / "step_0"
    doc = json.loads((step / "fz.json").read_text())
    doc["client_state"] = {"x": {mark: "model/" + next(iter(state.params))}}
    (step / "fz.json").write_text(json.dumps(doc))
    files = manifest.read(step)
    files.update(manifest.describe(step, ["fz.json"]))
    manifest.write(step, files)
    with pytest.raises(CheckpointError, match=r"fz.json refers to tensor 'model/.*', which is not one of its own"):
        fz.restore(fz.init(make_model(), spec(0, 1)), step, with_client_state=True)
