"""`fz.init(meta_model, spec, weights=folder)` on folders written by transformers' own
`save_pretrained` into several safetensors shards: at world 1 and 2, stages 0 and 3 (1 and 2
at world 2), offload none / cpu / nvme (parameters on disk), the logits equal
`from_pretrained`'s exactly and 3 fine-tuning steps follow the plain-torch reference; a bf16
folder gives fp32 masters equal to its values. Then bad folders, each refused naming the
cause, nothing unpickled; tied names in either form; and (a subprocess) the resident memory a
load adds stays bounded by the largest tensor, not the model."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fz
from fz.errors import CheckpointError, ConfigError

from support.hf_load_jobs import SHARD, build, cases, checks, on_meta, pretrained
from support.ranks import cached_runs

pytest.importorskip("transformers")
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    """Each model written by transformers' own save_pretrained, sharded (safetensors, its default)."""
    root = tmp_path_factory.mktemp("hf")
    for name in ("llama", "gpt2", "mixtral"):
        build(name).save_pretrained(root / name, max_shard_size=SHARD)
    build("llama", seed=1).to(torch.bfloat16).save_pretrained(root / "llama-bf16", max_shard_size=SHARD)
    return root


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def results(request, folders, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("load"))
    return request.param, cached_runs(request.param, checks, str(folders), tmp, timeout=500)


def test_folders_are_sharded_by_transformers(folders):
    for name in ("llama", "gpt2", "mixtral", "llama-bf16"):
        index = json.loads((folders / name / INDEX).read_text())
        assert len(set(index["weight_map"].values())) >= 2, name
    gpt2 = json.loads((folders / "gpt2" / INDEX).read_text())["weight_map"]
    assert "lm_head.weight" not in gpt2 and "transformer.wte.weight" in gpt2  # tied: written once
    assert any(".experts.0.w1.weight" in k for k in json.loads((folders / "mixtral" / INDEX).read_text())["weight_map"])


def test_logits_equal_from_pretrained_in_every_tier(results):
    world, ranks = results
    for rank, out in enumerate(ranks):
        for case in cases(world):
            assert out[case]["equal"], (world, rank, case, out[case]["diff"])


def test_fine_tuning_from_the_folder_follows_the_reference(results):
    world, ranks = results
    for rank, out in enumerate(ranks):
        for case in cases(world):
            assert out[case]["loss_rel"] < 1e-5 and not out[case]["params_off"], (world, rank, case, out[case])


def test_bf16_folder_gives_fp32_masters_of_its_values(results):
    world, ranks = results
    for out in ranks:
        assert out["bf16"]["masters_fp32"] and out["bf16"]["masters_equal"] and out["bf16"]["compute_equal"]
        assert torch.isfinite(torch.tensor(out["bf16"]["loss"]))


# -- bad input (world 1) --------------------------------------------------------------------


def _copy(folders: Path, tmp_path: Path, name: str = "llama") -> Path:
    return Path(shutil.copytree(folders / name, tmp_path / name))


def _index(folder: Path) -> dict:
    return json.loads((folder / INDEX).read_text())


def _write_index(folder: Path, index: dict) -> None:
    (folder / INDEX).write_text(json.dumps(index))


def _load(folder: Path, name: str = "llama", **spec_kw):
    spec = fz.Spec(stage=3, optimizer=fz.optim.adamw(lr=1e-2), **spec_kw)
    return fz.init(on_meta(name), spec, weights=folder)


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_missing_shard_is_named(folders, tmp_path):
    folder = _copy(folders, tmp_path)
    second = sorted(set(_index(folder)["weight_map"].values()))[1]
    (folder / second).unlink()
    with pytest.raises(CheckpointError, match=rf"names {second} \(for \d+ tensors, e\.g\. '(model|lm_head)\..*'\), "
                                              r"which does not exist .*a shard is missing"):
        _load(folder)


def test_an_index_naming_files_that_are_not_there(folders, tmp_path):
    folder = _copy(folders, tmp_path)
    index = _index(folder)
    index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    _write_index(folder, index)
    with pytest.raises(CheckpointError, match=r"names model-00009-of-00009.safetensors \(for 1 tensors, e.g. "
                                              r"'model.norm.weight'\), which does not exist"):
        _load(folder)
    index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    _write_index(folder, index)
    with pytest.raises(CheckpointError, match=r"names '../elsewhere.safetensors' for 'model.norm.weight': not a "
                                              r"\.safetensors file in the folder"):
        _load(folder)
    first = sorted(set(index["weight_map"].values()) - {"../elsewhere.safetensors"})[0]
    index["weight_map"]["model.norm.weight"] = first  # a shard that exists but does not hold it
    _write_index(folder, index)
    with pytest.raises(CheckpointError, match=rf"puts 1 tensors in {first} that it does not hold \(e.g. "
                                              r"'model.norm.weight'\): the index and the shards do not match"):
        _load(folder)


def test_a_shard_with_a_wrong_shape_is_named_before_anything_is_written(folders, tmp_path):
    from safetensors.torch import load_file, save_file
    folder = _copy(folders, tmp_path)
    shard = folder / _index(folder)["weight_map"]["model.norm.weight"]
    tensors = load_file(shard)
    tensors["model.norm.weight"] = torch.ones(33)
    save_file(tensors, shard, metadata={"format": "pt"})
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    with pytest.raises(ConfigError, match=r"shape mismatch: model.norm.weight is \(33,\) in the file, \(32,\) here"):
        _load(folder, offload=fz.offload.nvme(str(nvme), params=True))
    assert not list(nvme.rglob("*")) or all(p.is_dir() for p in nvme.rglob("*"))  # checked before any file


def test_missing_and_unexpected_names_strict_and_not(folders, tmp_path):
    from safetensors.torch import save_file
    folder = _copy(folders, tmp_path)
    index = _index(folder)
    del index["weight_map"]["model.norm.weight"]
    save_file({"extra.weight": torch.zeros(2)}, folder / "extra.safetensors")
    index["weight_map"]["extra.weight"] = "extra.safetensors"
    _write_index(folder, index)
    with pytest.raises(ConfigError, match=r"2 differences\): missing: model.norm.weight; unexpected: extra.weight"):
        _load(folder)
    state = fz.init(build("llama", seed=5), fz.Spec(stage=3, optimizer=fz.optim.adamw(lr=1e-2)))
    with pytest.warns(UserWarning, match="missing: model.norm.weight; unexpected: extra.weight"):
        state = fz.load_weights(state, folder, strict=False)
    full, want = fz.full_params(state), pretrained(folders / "llama").state_dict()
    assert all(torch.equal(full[k], want[k]) for k in full if k != "model.norm.weight")
    assert torch.equal(full["model.norm.weight"], build("llama", seed=5).state_dict()["model.norm.weight"])


def test_a_folder_of_pickled_weights_is_refused_unread(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    marker = tmp_path / "pwned"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin\) and no safetensors: not read: a pickle can run "
                                              r"code\. Convert it to safetensors with transformers"):
        _load(folder)
    (folder / "model.safetensors").write_bytes(pickle.dumps(_Evil(marker)))  # a pickle under the name
    with pytest.raises(CheckpointError, match="is not a safetensors file"):
        _load(folder)
    assert not marker.exists()


def test_tied_names_in_either_form(folders, tmp_path):
    from safetensors.torch import load_file, save_file
    ids = torch.randint(3, 64, (2, 8))
    want = pretrained(folders / "gpt2")(input_ids=ids).logits
    folder = _copy(folders, tmp_path, "gpt2")  # both names written: loads too
    index = _index(folder)
    shard = folder / index["weight_map"]["transformer.wte.weight"]
    tensors = load_file(shard)
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    save_file(tensors, shard, metadata={"format": "pt"})
    index["weight_map"]["lm_head.weight"] = shard.name
    _write_index(folder, index)
    state = _load(folder, "gpt2")
    assert torch.equal(fz.apply(state, input_ids=ids).logits, want)
    single = tmp_path / "one.safetensors"  # a single file (no folder) with every tensor
    save_file({k: v.contiguous() for k, v in pretrained(folders / "gpt2").state_dict().items()
               if k != "lm_head.weight"}, single)
    assert torch.equal(fz.apply(_load(single, "gpt2"), input_ids=ids).logits, want)


# -- resident memory -------------------------------------------------------------------------


@pytest.mark.slow  # the slow tier (.ci/run: -m slow)
def test_peak_rss_of_a_load_and_a_write_back_is_bounded_by_the_largest_tensor(tmp_path):
    """40 tensors of 8 MiB (320 MiB, 5 shards) into stage 3 with parameters on NVMe, in a fresh
    process: what the load adds to the resident memory (VmHWM, reset just before) stays under 3x
    the largest tensor + 24 MiB (the read chunk, its copy into the tier, and the allocator's and
    Python's slack); the whole model would be 320 MiB. fz.init(weights=) also makes each bucket's
    zeroed shard and Adam moments before writing them to their files, as fz.init always does:
    bounded by 4 buckets (Spec.bucket_mb, 25 MiB: those three, and one of memory the allocator
    keeps after freeing them) on top of the load's bound, not by the model (measured 62-97 MiB)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(Path(fz.__file__).parents[1]),
                                                                            str(Path(__file__).parents[1])]))
    out = subprocess.run([sys.executable, "-m", "support.hf_load_peak", str(tmp_path)], env=env, check=True,
                         capture_output=True, text=True, timeout=120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 2**20
    assert got["total"] == 40 * 8 * mib and got["largest"] == 8 * mib and got["shards"] >= 4, got
    bound = 3 * got["largest"] + 24 * mib
    assert got["load"] < bound, (got["load"] / mib, bound / mib)
    assert got["init"] < bound + 4 * 25 * mib, (got["init"] / mib, (bound + 100 * mib) / mib)
    assert got["equal"], got
    # writing back: `fz consolidate --hf` streams stored chunks (the load's bound); save_pretrained from the
    # live state (a 330 MiB Llama) gathers one 25 MiB bucket at a time and writes it: two buckets on top
    assert got["consolidate_hf"] < bound, (got["consolidate_hf"] / mib, bound / mib)
    assert got["save_pretrained"] < bound + 2 * 25 * mib, (got["save_pretrained"] / mib, (bound + 50 * mib) / mib)
    print(f"peak RSS added by load_weights: {got['load'] / mib:.1f} MiB (bound {bound / mib:.0f} MiB); "
          f"by fz.init(weights=): {got['init'] / mib:.1f} MiB; by save_pretrained: "
          f"{got['save_pretrained'] / mib:.1f} MiB; by consolidate --hf: {got['consolidate_hf'] / mib:.1f} MiB")
