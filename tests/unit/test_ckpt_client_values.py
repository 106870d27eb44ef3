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
          "flags": np.array([True, False]), "plain": {"epoch": 3, "loss": 1.5},
          "np_rng": np.random.RandomState(3).get_state(),  # a tuple holding a uint32 array
          "wide": np.array([2**64 - 1], dtype=np.uint64), "small": np.uint16(65535),
          "big_endian": np.arange(3, dtype=">i4")}


def same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    assert got["args"] == want["args"] and got["plain"] == want["plain"]
    for k in ("table", "flags", "best", "count", "wide", "small"):
        assert type(got[k]) is type(want[k]) and got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k])
    assert np.array_equal(got["big_endian"], want["big_endian"]) and got["big_endian"].dtype.isnative
    assert got["np_rng"][0] == want["np_rng"][0] and got["np_rng"][1].dtype == np.uint32
    assert np.array_equal(got["np_rng"][1], want["np_rng"][1]) and got["np_rng"][2:] == want["np_rng"][2:]
    generator = np.random.RandomState()
    generator.set_state(got["np_rng"])  # numpy takes it back
    assert generator.randint(1000) == np.random.RandomState(3).randint(1000)


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


def test_what_a_checkpoint_cannot_hold_is_refused_when_saved():
    with pytest.raises(fz.ConfigError, match="at 'x': a numpy object value, which fz's checkpoints do not hold"):
        encode({"x": np.array([object()])}, "client")
    with pytest.raises(fz.ConfigError, match="at 'x': a numpy float128 value|at 'x': a numpy longdouble value"):
        encode({"x": np.ones(2, dtype=np.longdouble)}, "client")
    with pytest.raises(fz.ConfigError, match="at 'x': a torch.uint32 tensor, which fz's checkpoints do not hold"):
        encode({"x": torch.ones(2, dtype=torch.uint32)}, "client")
    for name in ("__reduce_ex__", "_get_kwargs"):
        with pytest.raises(fz.ConfigError, match=f"an attribute '{name}' that shadows its own"):
            encode({"x": argparse.Namespace(**{name: 1})}, "client")
    with pytest.raises(fz.ConfigError, match="a dict whose one key is '__fz_tuple__'"):
        encode({"x": {"__fz_tuple__": [1]}}, "client")  # it would come back a tuple

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


@pytest.mark.parametrize("crafted, why", [
    ({"__fz_namespace__": {"__fz_tuple__": [1]}}, "is not a dict of attribute names"),
    ({"__fz_namespace__": {"__class__": 1}}, "is not a dict of attribute names"),
    ({"__fz_ndarray__": "client/b"}, "is a torch.bfloat16 tensor"),
    ({"__fz_ndarray_uint32__": "client/i"}, r"uint32 value \(client/i\) is int64"),
    ({"__fz_npscalar__": "client/i"}, r"scalar \(client/i\) has shape"),
])
def test_a_crafted_client_tree_is_a_checkpoint_error(crafted, why):
    tensors = {"client/b": torch.ones(2, dtype=torch.bfloat16), "client/i": torch.arange(3)}
    with pytest.raises(CheckpointError, match=why):
        decode({"x": crafted}, tensors)


def _crafted(tmp_path, client_state):
    """A checkpoint whose fz.json holds `client_state` as its encoded client tree (re-listed)."""
    fz.save(fz.init(make_model(), spec(0, 1)), tmp_path, client_state={"x": 1})
    step = tmp_path / "step_0"
    doc = json.loads((step / "fz.json").read_text())
    doc["client_state"] = client_state
    (step / "fz.json").write_text(json.dumps(doc))
    files = manifest.read(step)
    files.update(manifest.describe(step, ["fz.json"]))
    manifest.write(step, files)
    return step


@pytest.mark.parametrize("client_state, why", [
    ({"x": {"__fz_tuple__": 5}}, "a tuple whose items are a int, not a list"),
    ({"x": {"__fz_tuple__": "abc"}}, "a tuple whose items are a str, not a list"),  # was ('a', 'b', 'c')
    ({"x": {"__fz_namespace__": {"_get_kwargs": 1}}}, "an attribute '_get_kwargs' that shadows its own"),
    ({"x": {"__fz_tensor__": 3}}, "a __fz_tensor__ reference that is a int, not a key"),
    ([1, 2], r"its client_state '\[1, 2\]' is not the dict of names fz.save writes"),
    ({"__fz_namespace__": {"a": 1}}, "is not the dict of names fz.save writes"),
])
def test_a_client_tree_fz_save_never_writes_is_refused_before_anything_is_loaded(tmp_path, client_state, why):
    """A marker whose body is not what it marks was decoded as given (a raw TypeError after the
    template was given up, or a tuple of a string's letters); now refused while the restore plans,
    and the template is still usable."""
    step = _crafted(tmp_path / "bad", client_state)
    template = fz.init(make_model(), spec(0, 1))
    with pytest.raises(CheckpointError, match=why):
        fz.restore(template, step, with_client_state=True)
    fz.save(fz.init(make_model(), spec(0, 1)), tmp_path / "good")
    fz.restore(template, tmp_path / "good" / "step_0")  # the template was not given up


def test_what_an_older_fz_saved_deeper_restores_and_a_key_like_a_marker_round_trips(tmp_path):
    """fz.save took trees 256 levels deep before it took 100: one of those (500 levels encoded)
    restores, decoded without recursion; a client_state whose one key merely starts like a marker
    (`__fz_note`) is the dict it was."""
    deep: object = 1
    for _ in range(499):
        deep = [deep]
    step = _crafted(tmp_path / "old", {"x": deep})
    _, client = fz.restore(fz.init(make_model(), spec(0, 1)), step, with_client_state=True)
    depth, x = 0, client["x"]
    while isinstance(x, list):
        depth, x = depth + 1, x[0]
    assert (depth, x) == (499, 1)
    fz.save(fz.init(make_model(), spec(0, 1)), tmp_path / "note", client_state={"__fz_note": "hello"})
    _, client = fz.restore(fz.init(make_model(), spec(0, 1)), tmp_path / "note" / "step_0", with_client_state=True)
    assert client == {"__fz_note": "hello"}
