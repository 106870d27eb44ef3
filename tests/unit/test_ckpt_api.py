"""The checkpoint API's shape: fz.save(state, path) and fz.restore(state, path) take the state first
(fz 0.1's restore(path, state) still works, warning; any other pair is a ConfigError naming the
signature), and consolidate / inspect return frozen dataclasses that still answer dict reads, warning."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import fz
from fz.ckpt import CheckpointInfo, Consolidated, consolidate, inspect
from fz.errors import ConfigError

from support.helpers import make_model, rank_batches, spec

SIGNATURE = r"fz\.restore\(state, path\) needs an fz\.State and a checkpoint path \(str or os\.PathLike\), "


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    state = fz.init(make_model(), spec(0, 1))
    state, _ = fz.train_step(state, rank_batches(1, 1, 1)[0][0])
    fz.save(state, root / "ck")
    return root / "ck", fz.full_params(state)


def _template() -> fz.State:
    return fz.init(make_model(), spec(0, 1))


def _same(a, b) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_restore_takes_the_state_first_like_save(saved):
    root, want = saved
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new order warns about nothing
        for path in (root, str(root)):
            got = fz.restore(_template(), path)
            assert int(got.step) == 1 and _same(fz.full_params(got), want)
        got, client = fz.restore(_template(), root, step=1, with_client_state=True)
    assert int(got.step) == 1 and client == {}


def test_the_old_order_still_restores_and_warns_naming_the_new_call(saved):
    root, want = saved
    with pytest.warns(DeprecationWarning) as record:
        got = fz.restore(root, _template(), step=1)
    assert int(got.step) == 1 and _same(fz.full_params(got), want)
    assert len(record) == 1
    assert str(record[0].message) == ("fz.restore(path, state) is deprecated: call fz.restore(state, path), "
                                      "the state first as in fz.save and fz.load_weights")
    assert record[0].filename == __file__  # points at the caller's line


def test_a_wrong_pair_names_the_signature(saved, tmp_path):
    root, _ = saved
    state = _template()
    with pytest.raises(ConfigError, match=SIGNATURE + r"got \(PosixPath, str\)$"):
        fz.restore(root, "ckpt")
    with pytest.raises(ConfigError, match=SIGNATURE + r"got \(State, State\)$"):
        fz.restore(state, state)
    with pytest.raises(ConfigError, match=SIGNATURE + r"got \(State, NoneType\)$"):
        fz.restore(state, None)
    with pytest.raises(ConfigError, match=r"^fz\.save\(state, path\) needs an fz\.State and a checkpoint path "
                                          r"\(str or os\.PathLike\), got \(str, State\) \(the state comes first\)$"):
        fz.save(str(tmp_path), state)
    assert not (tmp_path / "step_0").exists()


def test_inspect_and_consolidate_return_frozen_dataclasses(saved, tmp_path):
    root, _ = saved
    info = inspect(root)
    assert isinstance(info, CheckpointInfo) and fz.CheckpointInfo is CheckpointInfo
    assert (info.step, info.train_step, info.world, info.stage, info.precision, info.master) == (1, 1, 1, 0, "fp32",
                                                                                                False)
    assert (info.key, info.signed, info.meta_error, info.verified, info.verify_error) == (False, False, None, True,
                                                                                         None)
    assert info.path == str(root / "step_1") and info.fz_version == fz.__version__
    assert info.tensors > info.model_tensors > 0 and info.bytes > info.model_bytes > 0
    assert inspect(root, verify=False).verified is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.step = 2
    out = consolidate(root, tmp_path / "m.safetensors", progress=False)
    assert isinstance(out, Consolidated) and fz.Consolidated is Consolidated
    assert dataclasses.asdict(out) == {"checkpoint": str(root / "step_1"), "out": str(tmp_path / "m.safetensors"),
                                       "tensors": info.model_tensors, "bytes": info.model_bytes,
                                       "chunks": info.model_tensors}
    assert {"CheckpointInfo", "Consolidated"} <= set(fz.__all__) & set(fz.ckpt.__all__)


def test_reading_a_result_by_key_still_works_and_warns(saved, tmp_path):
    root, _ = saved
    info = inspect(root)
    with pytest.warns(DeprecationWarning) as record:
        assert info["step"] == 1
    assert str(record[0].message) == ("['step'] on the result of fz.ckpt.inspect is deprecated: it returns a "
                                      "CheckpointInfo dataclass now; read .step")
    assert record[0].filename == __file__
    out = consolidate(root, tmp_path / "m.safetensors", progress=False)
    with pytest.warns(DeprecationWarning, match=r"^\['out'\] on the result of fz\.ckpt\.consolidate is deprecated"):
        assert out["out"] == str(tmp_path / "m.safetensors")
    with pytest.warns(DeprecationWarning):
        # as the dicts did: the keys they left out (no metadata error; not verified) are absent
        assert "meta_error" not in info and "verified" in info
        unverified = inspect(root, verify=False)
        assert unverified.get("verified", True) is True and "verify_error" not in unverified
        assert dict(info) == {k: v for k, v in dataclasses.asdict(info).items() if k != "meta_error"}
        with pytest.raises(KeyError):
            info["meta_error"]
        with pytest.raises(KeyError):
            out["nope"]


def test_consolidate_refuses_weights_its_cast_makes_inf(tmp_path):
    """A weight of 1e6 is finite in the checkpoint and inf as fp16: `fz consolidate --dtype fp16` refuses
    it (fz.NonFiniteError naming the tensor and the cast), writing nothing; bf16 keeps fp32's range."""
    model = make_model()
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = 1e6
    fz.save(fz.init(model, spec(0, 1)), tmp_path / "ck")
    name = next(n for n, _ in model.named_parameters())
    with pytest.raises(fz.NonFiniteError, match=rf"fz consolidate: checkpoint .* cast to float16 holds NaN or inf in 1 "
                                                rf"tensors \(1 values\): '{name}' 1 of .*nothing was written"):
        consolidate(tmp_path / "ck", tmp_path / "m16.safetensors", dtype="fp16", progress=False)
    assert not (tmp_path / "m16.safetensors").exists()
    consolidate(tmp_path / "ck", tmp_path / "m.safetensors", dtype="bf16", progress=False)
    from safetensors.torch import load_file
    assert float(load_file(str(tmp_path / "m.safetensors"))[name].flatten()[0]) == pytest.approx(1e6, rel=1e-2)
