"""Keyed checkpoints (HMAC-SHA256 over the manifest): a checkpoint saved with a key restores
with it; one modified by someone without the key (files and manifest recomputed, as crc32
allows), unsigned, or signed with another key is refused by restore, consolidate and inspect
naming why; ranks holding different keys fail the save on every rank."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import fz
from fz.ckpt import manifest
from fz.cli import main
from fz.errors import ConfigError
from fz.testing.spawn import run_ranks

from support.helpers import make_model, rank_batches, spec

KEY = "k" * 32
OTHER = b"o" * 32


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    root = tmp_path_factory.mktemp("signed")
    state = fz.init(make_model(), spec(3, 1))
    state, _ = fz.train_step(state, rank_batches(1, 1, 1)[0][0])
    want = {k: v.clone() for k, v in fz.full_params(state).items()}
    fz.save(state, root / "ck", key=KEY)
    fz.save(state, root / "plain")
    return root / "ck" / "step_1", root / "plain" / "step_1", want


def _restore(d, **kw):
    return fz.restore(fz.init(make_model(), spec(0, 1)), d, **kw)


def _forged(src, dst, want):
    """The legitimate checkpoint with one weight changed in its data file, every checksum and the
    table's own crc recomputed, and the old signature kept: all an attacker without the key can do."""
    shutil.copytree(src, dst)
    body = json.loads((dst / "manifest.json").read_text())
    data = next(p for p in dst.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    at = raw.find(want["wte.weight"].numpy().tobytes())
    assert at > 0
    raw[at:at + 4] = torch.tensor([1234.0]).numpy().tobytes()
    data.write_bytes(bytes(raw))
    manifest.write(dst, dict(body["files"], **manifest.describe(dst, [data.name], "sha256")))
    forged = json.loads((dst / "manifest.json").read_text())
    (dst / "manifest.json").write_text(json.dumps(dict(forged, hmac=body["hmac"])))
    return dst


def test_a_signed_checkpoint_restores_with_its_key_and_refuses_forgeries(signed, tmp_path, monkeypatch, capsys):
    ck, plain, want = signed
    body = json.loads((ck / "manifest.json").read_text())
    assert isinstance(body["hmac"], str) and {f["algorithm"] for f in body["files"].values()} == {"sha256"}
    assert json.loads((ck / "fz.json").read_text())["signed"] is True
    assert KEY not in "".join(p.read_bytes().decode("latin-1") for p in ck.iterdir())  # the key is never written
    got = fz.full_params(_restore(ck, key=KEY))
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert int(_restore(ck).step) == 1  # without a key: checksums only, as an unsigned checkpoint

    forged = _forged(ck, tmp_path / "forged", want)
    poisoned = fz.full_params(_restore(forged))["wte.weight"]  # checksums alone cannot tell: it is self-consistent
    assert float(poisoned[0, 0]) == 1234.0
    for d, why in ((forged, "does not carry this key's signature"), (plain, "is not signed")):
        with pytest.raises(fz.CheckpointError, match=why):
            _restore(d, key=KEY)
        with pytest.raises(fz.CheckpointError, match=why):
            fz.ckpt.consolidate(d, tmp_path / "out.safetensors", key=KEY, verify=False)  # a key always verifies
        assert not (tmp_path / "out.safetensors").exists()
    with pytest.raises(fz.CheckpointError, match="does not carry this key's signature"):
        _restore(ck, key=OTHER)
    with pytest.raises(ConfigError, match="needs at least 16"):
        _restore(ck, key="short")

    monkeypatch.setenv("FZ_CKPT_KEY", KEY)  # the environment's key: used by fz.restore and the fz command
    with pytest.raises(fz.CheckpointError, match="does not carry this key's signature"):
        _restore(forged)
    assert main(["inspect", str(forged)]) == 1
    out = capsys.readouterr().out
    assert "signed" in out and "yes (HMAC-SHA256), checked below with FZ_CKPT_KEY" in out, out
    assert "FAILED" in out and "does not carry this key's signature" in out, out
    assert main(["consolidate", str(ck), str(tmp_path / "ok.safetensors")]) == 0
    got = fz.full_params(fz.load_weights(fz.init(make_model(), spec(0, 1)), tmp_path / "ok.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)
    monkeypatch.delenv("FZ_CKPT_KEY")
    assert main(["inspect", str(ck)]) == 0
    assert "not checked (set FZ_CKPT_KEY to check it)" in capsys.readouterr().out


def _ranks_keys(rank: int, world: int, root: str) -> dict:
    state = fz.init(make_model(), spec(3, 1))
    out = {}
    fz.save(state, root + "/same", key=KEY)
    for name, key in (("one_without", KEY if rank == 0 else None), ("different", KEY if rank == 0 else OTHER)):
        try:
            fz.save(state, f"{root}/{name}", key=key)
            out[name] = "saved"
        except ConfigError as e:
            out[name] = str(e)
    return out


def test_ranks_with_different_keys_fail_the_save_on_every_rank(tmp_path):
    results = run_ranks(2, _ranks_keys, str(tmp_path), timeout=120)
    for r in results:
        for name in ("one_without", "different"):
            assert "the ranks were given different checkpoint keys (rank 1 vs rank 0" in r[name], (name, r[name])
    assert (tmp_path / "same" / "latest").exists()
    assert not [p for n in ("one_without", "different") for p in (tmp_path / n).glob("step_*")]
    assert int(_restore(tmp_path / "same", key=KEY).step) == 0
