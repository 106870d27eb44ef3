"""A checkpoint from an untrusted source never runs code: a crafted pickle in any of its files
is refused or ignored by restore, inspect, consolidate and load_weights; a marker file that the
pickle would create never appears. Nor does restore read outside the checkpoint's folder (a
symlink, a '..' in the manifest), wait on a FIFO, trust a size its zip directory states, take
100k-deep JSON as more than a named error, or keep a template's values no chunk holds."""
from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import struct
import time
import zipfile
import zlib

import pytest
import torch

import fz
from fz.ckpt import manifest
from fz.ckpt.chunk import read_chunk
from fz.cli import main
from fz.errors import ConfigError

from support.fifo import fed_fifo
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


def _copy(saved, tmp_path):
    """(a copy of the saved checkpoint root, its step folder)."""
    ck_dir, _ = saved
    root = tmp_path / "ck"
    shutil.copytree(ck_dir.parent, root)
    return root, root / ck_dir.name


def _restore(path):
    return fz.restore(fz.init(make_model(), spec(1, 1)), path)


def _list(step, extra: dict) -> None:
    """The manifest lists `extra` ({name: entry}) besides its files, its own checksum fixed."""
    files = manifest.read(step)
    files.update(extra)
    manifest.write(step, files)


def _symlinked_data(root, step, tmp_path):
    outside = tmp_path / "elsewhere.distcp"
    shutil.copy(step / "__0_0.distcp", outside)
    (step / "__0_0.distcp").unlink()
    (step / "__0_0.distcp").symlink_to(outside)
    _rewrite(step, "__0_0.distcp", outside.read_bytes())  # through the link: the manifest agrees
    return step, r"__0_0.distcp leads to .*elsewhere.distcp, outside the checkpoint folder"


def _symlinked_step(root, step, tmp_path):
    shutil.copytree(step, tmp_path / "other")
    shutil.rmtree(step)
    step.symlink_to(tmp_path / "other", target_is_directory=True)
    return root, rf"checkpoint step folder .*{step.name} leads to .*other, outside the checkpoint folder"


def _symlinked_tag(root, step, tmp_path):
    shutil.copytree(step, tmp_path / "other")
    (root / "tagx").symlink_to(tmp_path / "other", target_is_directory=True)
    (root / "latest").write_text("tagx\n")  # a DeepSpeed-style `latest`: the tag alone
    return root, r"checkpoint step folder .*tagx leads to .*other, outside the checkpoint folder"


def _named(name):
    def tamper(root, step, tmp_path):
        _list(step, {name: {"size": 0, "checksum": "0", "algorithm": "xxh3"}})
        return step, rf"lists '{re.escape(name)}', which is not a file name of"
    tamper.__name__ = f"listed_{name}"
    return tamper


@pytest.mark.parametrize("tamper", [_symlinked_data, _symlinked_step, _symlinked_tag, _named("../../secret.bin"),
                                    _named("/dev/zero")], ids=lambda f: f.__name__)
def test_a_file_leading_out_of_the_checkpoint_is_refused_unread(saved, tmp_path, tamper):
    """A downloaded checkpoint may hold links anywhere: fz reads only inside the folder it was given."""
    root, step = _copy(saved, tmp_path)
    path, message = tamper(root, step, tmp_path)
    with pytest.raises(fz.CheckpointError, match=message):
        _restore(path)


@pytest.mark.parametrize("name", ["manifest.json", "index.json", "pipe", "chunk"])
def test_a_fifo_in_the_checkpoint_is_refused_without_blocking(saved, tmp_path, name):
    """A FIFO as the manifest, a listed file, or a chunk's file of index.json would block the reader."""
    _, step = _copy(saved, tmp_path)
    fifo = step / ("evil.distcp" if name == "chunk" else name)
    if fifo.exists():
        fifo.unlink()
    if name == "chunk":
        index = json.loads((step / "index.json").read_text())
        at = 0
        for t in index["tensors"].values():
            for c in t["chunks"]:  # each its own bytes of the FIFO, as long as its record
                c.update(file="evil.distcp", at=at)
                at += c["length"]
        _rewrite(step, "index.json", json.dumps(index).encode())
    with fed_fifo(fifo):
        if name in ("pipe", "chunk"):  # listed: a file the manifest does not list is refused before it is looked at
            _list(step, {fifo.name: {"size": 0, "checksum": "0", "algorithm": "xxh3"}})
        start = time.monotonic()
        with pytest.raises(fz.CheckpointError, match=rf"{fifo.name} is not a regular file \(a FIFO\): not read"):
            _restore(step)
        assert time.monotonic() - start < 60


@pytest.mark.parametrize("name", ["manifest.json", "index.json", "fz.json"])
def test_json_nested_past_the_recursion_limit_is_named_not_a_recursion_error(saved, tmp_path, name):
    _, step = _copy(saved, tmp_path)
    deep = b"[" * 100_000 + b"]" * 100_000
    if name == "manifest.json":
        (step / name).write_bytes(deep)
    else:
        _rewrite(step, name, deep)
    with pytest.raises(fz.CheckpointError, match=rf"{name} nests deeper than Python's recursion limit"):
        _restore(step)


@pytest.mark.parametrize("twice, said", [
    (False, r"its chunks hold 0 values, the tensor \[.*\] has \d+: some values are in no chunk"),
    (True, r"chunks at \[0, 0\] and \[0, 0\] overlap, so some values are in no chunk"),
])
def test_an_index_whose_chunks_miss_values_is_refused_naming_the_tensor(saved, tmp_path, twice, said):
    """A value no chunk holds would silently keep the template's: no chunk at all, or the one chunk
    twice in a tensor of twice its rows (as many values, half of them in no chunk)."""
    _, step = _copy(saved, tmp_path)
    index = json.loads((step / "index.json").read_text())
    key = next(k for k, t in index["tensors"].items() if k.startswith("model/") and len(t["size"]) == 2)
    t = index["tensors"][key]
    assert len(t["chunks"]) == 1  # saved by one rank
    t["chunks"] = t["chunks"] * 2 if twice else []
    t["size"][0] *= 2 if twice else 1
    _rewrite(step, "index.json", json.dumps(index).encode())
    with pytest.raises(fz.CheckpointError, match=rf"index.json is unreadable or damaged .*'{key}': .*{said}"):
        _restore(step)


def _lying_record(n: int) -> bytes:
    """A torch.save record of a float storage of `n` elements whose zip directory says data/0 holds
    n * 4 bytes: the file holds 20."""
    def text(x: str) -> bytes:
        return pickle.BINUNICODE + struct.pack("<I", len(x)) + x.encode()

    def i(x: int) -> bytes:
        return pickle.BININT + struct.pack("<i", x)

    def glob(m: str, name: str) -> bytes:
        return pickle.GLOBAL + f"{m}\n{name}\n".encode()

    pid = pickle.MARK + text("storage") + glob("torch", "FloatStorage") + text("0") + text("cpu") + i(n) \
        + pickle.TUPLE + pickle.BINPERSID
    args = pid + i(0) + pickle.MARK + i(5) + pickle.TUPLE + pickle.MARK + i(1) + pickle.TUPLE + pickle.NEWFALSE \
        + glob("collections", "OrderedDict") + pickle.EMPTY_TUPLE + pickle.REDUCE
    pkl = pickle.PROTO + b"\x02" + glob("torch._utils", "_rebuild_tensor_v2") + pickle.MARK + args + pickle.TUPLE \
        + pickle.REDUCE + pickle.STOP
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", b"little")
        z.writestr("archive/data/0", b"\0" * 20)
    raw = bytearray(buf.getvalue())
    struct.pack_into("<II", raw, raw.rfind(b"PK\x01\x02") + 20, 20, n * 4)  # data/0: the lie
    return bytes(raw)


def test_a_chunk_is_not_allocated_from_a_size_its_zip_directory_states(tmp_path):
    """Its sizes and offsets are checked against the chunk's bytes first: 4 GB is never allocated
    for a record of 510 bytes."""
    f = tmp_path / "__0_0.distcp"
    f.write_bytes(_lying_record(10**9 - 1))
    start = time.monotonic()
    with pytest.raises(fz.CheckpointError, match=r"__0_0.distcp is unreadable: .*data/0 claims 3999999996 bytes "
                                                 r"at byte \d+, past the chunk's \d+ bytes"):
        read_chunk(f, 0, f.stat().st_size, torch.float32, (5,))
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("name, said", [
    ("a" * 300, r"a chunk's file 'a+ is not a plain file name of the folder"),
    ("unlisted.distcp", r"names 'unlisted.distcp', a file its manifest does not list \(whose checksum"),
])
def test_a_chunk_file_must_be_a_plain_name_the_manifest_lists(saved, tmp_path, name, said):
    """index.json names the chunks' files: one the manifest does not list was never checksummed (an
    unsigned checkpoint's index may be rewritten with its manifest's crc), a name over NAME_MAX was a
    raw OSError."""
    _, step = _copy(saved, tmp_path)
    data = next(p for p in step.iterdir() if p.suffix == ".distcp")
    if "/" not in name and len(name) < 255:
        shutil.copy(data, step / name)
    index = json.loads((step / "index.json").read_text())
    for t in index["tensors"].values():
        for c in t["chunks"]:
            if c["file"] == data.name:
                c["file"] = name
    _rewrite(step, "index.json", json.dumps(index).encode())
    with pytest.raises(fz.CheckpointError, match=said):
        _restore(step)
