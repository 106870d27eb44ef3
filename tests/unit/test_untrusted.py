"""A checkpoint from an untrusted source never runs code: a crafted pickle in any of its files
is refused or ignored by restore, inspect, consolidate and load_weights; a marker file that the
pickle would create never appears."""
from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import struct
import zipfile
import zlib

import pytest
import torch

import fz
from fz.ckpt import manifest
from fz.cli import main
from fz.errors import ConfigError

from support.helpers import make_model, rank_batches, spec


class _Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _evil(marker) -> bytes:
    return pickle.dumps(_Evil(marker), protocol=2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("untrusted")
    state = fz.init(make_model(), spec(1, 1))
    state, _ = fz.train_step(state, rank_batches(1, 1, 1)[0][0])
    fz.save(state, root / "ck")
    full = fz.full_params(state)
    return root / "ck" / "step_1", {k: v.clone() for k, v in full.items()}


def _rewrite(dst, name: str, data: bytes) -> None:
    """`name` replaced by `data`, with a manifest that agrees (crc32 is no authentication)."""
    (dst / name).write_bytes(data)
    files = manifest.read(dst)
    files.update(manifest.describe(dst, [name]))
    manifest.write(dst, files)


def _poison_first_record(path, marker) -> None:
    """The data file's first torch.save record gets a data.pkl that runs code, at the same
    length and with its CRCs fixed, so the zip is valid and every offset still holds."""
    raw = bytearray(path.read_bytes())
    index = json.loads((path.parent / "index.json").read_text())
    first = min((c for t in index["tensors"].values() for c in t["chunks"] if c["file"] == path.name),
                key=lambda c: c["at"])
    at, length = first["at"], first["length"]
    z = zipfile.ZipFile(io.BytesIO(bytes(raw[at:at + length])))
    info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    payload = _evil(marker)
    assert len(payload) <= info.file_size
    payload = payload + b" " * (info.file_size - len(payload))  # after STOP: never read by pickle
    name_len, extra_len = struct.unpack("<HH", raw[at + info.header_offset + 26:at + info.header_offset + 30])
    start = at + info.header_offset + 30 + name_len + extra_len
    raw[start:start + len(payload)] = payload
    crc = struct.pack("<I", zlib.crc32(payload))
    raw[at + info.header_offset + 14:at + info.header_offset + 18] = crc
    central = raw.find(b"PK\x01\x02", at, at + length)
    while central >= 0:
        n = struct.unpack("<H", raw[central + 28:central + 30])[0]
        if bytes(raw[central + 46:central + 46 + n]) == info.filename.encode():
            raw[central + 16:central + 20] = crc
            break
        central = raw.find(b"PK\x01\x02", central + 4, at + length)
    zipfile.ZipFile(io.BytesIO(bytes(raw[at:at + length]))).testzip()  # still a valid zip
    _rewrite(path.parent, path.name, bytes(raw))


def _attempts(ck, tmp_path):
    """Every way fz reads a checkpoint: (what, outcome) with outcome 'ok' or the error."""
    out = []
    for what, call in (
            ("restore", lambda: fz.restore(fz.init(make_model(), spec(1, 1)), ck)),
            ("inspect", lambda: main(["inspect", str(ck)])),
            ("consolidate", lambda: main(["consolidate", str(ck), str(tmp_path / "out.safetensors")]))):
        try:
            result = call()
            out.append((what, "ok" if result in (None, 0) or isinstance(result, fz.State) else f"exit {result}"))
        except ConfigError as e:
            out.append((what, str(e)))
    return out


@pytest.mark.parametrize("target", [".metadata", "index.json", "fz.json", "manifest.json", "data_0.json",
                                    "__0_0.distcp", "latest"])
def test_a_crafted_pickle_in_any_checkpoint_file_never_runs(saved, tmp_path, target):
    ck_dir, _ = saved
    root = tmp_path / "ck"
    shutil.copytree(ck_dir.parent, root)
    ck = root / ck_dir.name
    marker = tmp_path / "pwned"
    if target == "__0_0.distcp":
        _poison_first_record(ck / target, marker)
    elif target == "latest":
        (root / "latest").write_bytes(_evil(marker))
    elif target == "manifest.json":
        (ck / target).write_bytes(_evil(marker))
    else:
        _rewrite(ck, target, _evil(marker))
    results = _attempts(root if target == "latest" else ck, tmp_path)
    assert not marker.exists(), (target, results)
    restore = dict(results)["restore"]
    if target == ".metadata":  # DCP's pickled index: fz never reads it, the checkpoint loads
        assert all(outcome == "ok" for _, outcome in results), results
    else:  # restore reads every file: refused, naming it (inspect and consolidate: refused or unaffected)
        assert target in restore, restore


def test_load_weights_never_unpickles(saved, tmp_path):
    marker = tmp_path / "pwned"
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(_evil(marker))
    with pytest.raises(ConfigError):
        fz.load_weights(fz.init(make_model(), spec(1, 1)), bad)
    assert not marker.exists()


def test_a_checkpoint_with_only_dcps_pickled_index_is_refused_naming_why(saved, tmp_path):
    ck_dir, full = saved
    ck = tmp_path / ck_dir.name
    shutil.copytree(ck_dir, ck)
    (ck / "index.json").unlink()
    files = manifest.read(ck)
    files.pop("index.json")
    manifest.write(ck, files)
    with pytest.raises(ConfigError, match=r"only DCP's .metadata, a pickle, which fz never reads"):
        fz.restore(fz.init(make_model(), spec(1, 1)), ck)
    restored = fz.restore(fz.init(make_model(), spec(1, 1)), ck_dir)  # the intact one loads exactly
    for k, v in fz.full_params(restored).items():
        assert torch.equal(v, full[k]), k


def test_a_manifest_of_the_wrong_shape_is_named_not_a_traceback(saved, tmp_path):
    ck_dir, _ = saved
    for i, files in enumerate([[], ["index.json"], "x"]):
        ck = tmp_path / f"step_{i}"
        shutil.copytree(ck_dir, ck)
        crc = f"{zlib.crc32(json.dumps(files, sort_keys=True).encode()):08x}"  # self-consistent, wrong shape
        (ck / "manifest.json").write_text(json.dumps({"files": files, "table_crc": crc}))
        with pytest.raises(ConfigError, match=f"{ck / 'manifest.json'} is unreadable .*the manifest is damaged"):
            fz.restore(fz.init(make_model(), spec(1, 1)), ck)
