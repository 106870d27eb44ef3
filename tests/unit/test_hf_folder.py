"""`fz consolidate --hf` (fz/ckpt/hf/folder.py): shard sizes as transformers spells them, shards
cut at the limit, and a write that fails leaves the earlier folder whole and nothing half-written."""
from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

import fz
from fz.ckpt import consolidate
from fz.ckpt.hf import safetensors_io
from fz.ckpt.hf.folder import shard_size, shards

from support.helpers import make_model, spec


def test_shard_sizes_and_cuts():
    assert shard_size("5GB") == 5 * 10**9 and shard_size("2GiB") == 2 * 2**30 and shard_size(1000) == 1000
    assert shard_size("500mb") == 500 * 10**6
    for bad in ("5 parsecs", 0, "-1GB"):
        with pytest.raises(fz.ConfigError, match="max_shard_size="):
            shard_size(bad)
    assert shards([("a", 6), ("b", 5), ("c", 20), ("d", 1)], 10) == [["a"], ["b"], ["c"], ["d"]]
    assert shards([("a", 4), ("b", 5), ("c", 1), ("d", 1)], 10) == [["a", "b", "c"], ["d"]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_folder")
    state = fz.init(make_model(), spec(0, 1))
    fz.save(state, root / "ck", verbose=False)
    (root / "config.json").write_text('{"model_type": "test"}')  # beside the root, as in a Trainer's checkpoint-N/
    (root / "trainer_state.json").write_text("{}")
    return root / "ck", {k: v.clone() for k, v in fz.full_params(state).items()}


def test_only_a_trainers_checkpoint_folder_lends_the_root_its_files(tmp_path):
    """A folder above the checkpoint that is no Trainer's checkpoint-N/ (a home folder) keeps its
    config.json and *.model files; the root's own are taken first."""
    state = fz.init(make_model(), spec(0, 1))
    fz.save(state, tmp_path / "ck", verbose=False)
    for name in ("config.json", "tokenizer.json", "id_rsa_backup.model"):
        (tmp_path / name).write_text("not the checkpoint's")
    consolidate(tmp_path / "ck", tmp_path / "hf", hf=True)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors"]
    (tmp_path / "ck" / "config.json").write_text('{"model_type": "own"}')
    (tmp_path / "ck" / "tokenizer.model").write_text("spm")
    (tmp_path / "trainer_state.json").write_text("{}")
    consolidate(tmp_path / "ck", tmp_path / "hf2", hf=True)
    assert sorted(p.name for p in (tmp_path / "hf2").iterdir()) == ["config.json", "model.safetensors",
                                                                     "tokenizer.model"]
    assert (tmp_path / "hf2" / "config.json").read_text() == '{"model_type": "own"}'


def test_the_folder_holds_every_weight_once_in_shards_with_the_config(ckpt, tmp_path):
    root, weights = ckpt
    consolidate(root, tmp_path / "hf", hf=True, max_shard_size=4096)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(weights) - set(index["weight_map"]) == {"head.weight"}  # tied to the embedding: written once
    assert len(set(index["weight_map"].values())) > 1
    got = {}
    for f in set(index["weight_map"].values()):
        got.update(load_file(tmp_path / "hf" / f))
    assert set(got) == set(index["weight_map"]) and all(got[k].equal(weights[k]) for k in got)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in got.values())
    assert (tmp_path / "hf" / "config.json").read_text() == '{"model_type": "test"}'


def test_a_failed_write_leaves_the_earlier_folder_whole(ckpt, tmp_path, monkeypatch):
    root, _ = ckpt
    out = tmp_path / "hf"
    consolidate(root, out, hf=True, max_shard_size=4096)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls = []
    real = safetensors_io.StreamWriter.close

    def failing(self):
        calls.append(self.path)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        return real(self)

    monkeypatch.setattr(safetensors_io.StreamWriter, "close", failing)
    with pytest.raises(OSError, match="Input/output error"):
        consolidate(root, out, hf=True, max_shard_size=4096)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no staging folder left either
