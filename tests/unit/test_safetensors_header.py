"""A safetensors header written by hand to be hostile is refused by fz.load_weights and
fz.init(weights=) as safetensors' own `safe_open` refuses it: a CheckpointError naming the file
and the cause, before any value is read. So are headers too large or too deep, and files that
are not regular files (a FIFO named model.safetensors would otherwise block the loader), shards
that lead out of the folder, and a hostile config.json beside weights that do not fit."""
from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

import fz
from fz.errors import CheckpointError

from support.fifo import fed_fifo


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)


@pytest.fixture(scope="module")
def state():
    return fz.init(Net(), fz.Spec(stage=0, optimizer=fz.optim.adamw(lr=1e-2)))


def _write(path: Path, header, data: bytes = b"") -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _t(begin: int, end: int, shape=(2,), dtype="F32") -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


Z8, Z12, Z20 = b"\0" * 8, b"\0" * 12, b"\0" * 20
# (header, data, what fz says): each also refused by safetensors' safe_open
HOSTILE = {
    "partial overlap": ({"a": _t(0, 8), "b": _t(4, 12)}, Z12,
                        r"is damaged: tensors 'a' \(bytes 0..8 of the data\) and 'b' \(bytes 4..12\) overlap"),
    "same bytes twice": ({"a": _t(0, 8), "b": _t(0, 8)}, Z8, r"tensors 'a' .* and 'b' \(bytes 0..8\) overlap"),
    "overlap inside": ({"a": _t(0, 16, (4,)), "b": _t(4, 12)}, b"\0" * 16, r"tensors 'a' .* and 'b' .* overlap"),
    "gap": ({"a": _t(0, 8), "b": _t(12, 20)}, Z20, r"bytes 8..12 of its data belong to no tensor \(before 'b'\)"),
    "trailing bytes": ({"a": _t(0, 8)}, Z12, r"4 bytes after its last tensor belong to no tensor"),
    "truncated": ({"a": _t(0, 8)}, b"\0" * 4, r"is truncated: its header places tensors up to byte 8 .* holds 4"),
    "string offsets": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}}, Z8,
                       r"tensor 'a' has data_offsets \['0', '8'\]: must be two integers"),
    "float offsets": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8]}}, Z8, "must be two integers"),
    "negative offsets": ({"a": _t(-8, 0)}, Z8, "must be two integers >= 0"),
    "three offsets": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 8]}}, Z8, "must be two integers"),
    "ends before it begins": ({"a": _t(8, 0, (0,)), "b": _t(0, 8)}, Z8, r"'a' has data_offsets 8..0, which end before"),
    "shape against bytes": ({"a": _t(0, 8, (3,))}, Z8,
                            r"tensor 'a' of shape \(3,\) torch.float32 needs 12 bytes, its data_offsets 0..8 hold 8"),
    "string shape": ({"a": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}}, Z8,
                     r"tensor 'a' has shape \['2'\]: must be a list of integers"),
    "unknown dtype": ({"a": _t(0, 8, dtype="X9")}, Z8, r"tensor 'a' has dtype 'X9', not one fz reads"),
    "metadata not strings": ({"__metadata__": {"format": 1}, "a": _t(0, 8)}, Z8,
                             "its __metadata__ is not a map of strings to strings"),
    "not an object": ([_t(0, 8)], Z8, "its header is not a JSON object"),
    "entry not an object": ({"a": [0, 8]}, Z8, "tensor 'a' has a header entry that is not an object"),
}
# names safetensors takes, but no model has: a name reaches every error and warning, and a terminal's control
# codes (or megabytes of it) were printed as given
ODD_NAMES = {"\x1b[2Jfz: OK\na": r"a tensor name '\\x1b\[2Jfz: OK\\na' \(12 characters\) that no model has: control",
             "w" * 5000: r"\(5000 characters\) that no model has: .* over 1024"}


@pytest.mark.parametrize("name", list(ODD_NAMES), ids=["control codes", "5000 characters"])
def test_a_tensor_name_no_model_has_is_refused_unprinted(state, tmp_path, name):
    _write(tmp_path / "model.safetensors", {name: _t(0, 8)}, Z8)
    with pytest.raises(CheckpointError, match=ODD_NAMES[name]):
        fz.load_weights(state, tmp_path)


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_header_is_refused_as_safetensors_refuses_it(state, tmp_path, case):
    header, data, said = HOSTILE[case]
    f = _write(tmp_path / "model.safetensors", header, data)
    with pytest.raises(Exception):  # noqa: B017 - safetensors' own reader: any refusal
        with safe_open(str(f), "pt"):
            pass
    with pytest.raises(CheckpointError, match=said) as e:
        fz.load_weights(state, tmp_path)
    assert str(f) in str(e.value)


def test_fz_init_refuses_before_it_allocates(tmp_path):
    _write(tmp_path / "model.safetensors", {"a.weight": _t(0, 16, (2, 2)), "a.bias": _t(8, 16)}, b"\0" * 16)
    with pytest.raises(CheckpointError, match=r"model.safetensors is damaged: tensors 'a.weight' .* 'a.bias' .* "
                                              "overlap"):
        fz.init(Net(), fz.Spec(stage=0), weights=tmp_path)


def test_a_name_twice_is_refused(state, tmp_path):
    """safetensors' parser keeps the last of a repeated name; fz refuses the ambiguity."""
    one = json.dumps(_t(0, 8))
    f = _write(tmp_path / "x.safetensors", f'{{"a": {one}, "a": {one}}}'.encode(), Z8)
    with pytest.raises(CheckpointError, match=r"x.safetensors is not a safetensors file: its header is not JSON "
                                              r"\(the key 'a' appears twice\)"):
        fz.load_weights(state, f)


def test_a_deep_header_is_refused_not_a_recursion_error(state, tmp_path):
    f = _write(tmp_path / "deep.safetensors", b"[" * 200_000)
    with pytest.raises(CheckpointError, match="deep.safetensors is not a safetensors file: its header nests deeper"):
        fz.load_weights(state, f)
    index = tmp_path / "folder"
    index.mkdir()
    (index / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 200_000)
    with pytest.raises(CheckpointError, match="safetensors index .*model.safetensors.index.json nests deeper"):
        fz.load_weights(state, index)


def test_a_header_over_100mb_is_refused_unread(state, tmp_path):
    f = tmp_path / "big.safetensors"
    n = (100 << 20) + 1
    f.write_bytes(struct.pack("<Q", n))
    os.truncate(f, 8 + n + 8)  # sparse: the header's bytes are never written, nor read
    with pytest.raises(CheckpointError, match=rf"big.safetensors has a header of {n} bytes, over safetensors' limit"):
        fz.load_weights(state, f)


def _feeder(fifo: Path) -> threading.Thread:
    """A writer for `fifo`: a loader that blocked opening it would get bytes and an end, not hang."""
    def feed():
        try:
            with open(fifo, "wb") as w:
                w.write(b"\xff" * 16)
        except BrokenPipeError:
            pass

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    return t


def _release(fifo: Path, feeder: threading.Thread) -> None:
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # lets a feeder still waiting to open go on
    feeder.join()
    os.close(fd)


@pytest.mark.parametrize("name", ["model.safetensors", "model.safetensors.index.json"])
def test_a_fifo_in_the_folder_is_refused_not_waited_on(state, tmp_path, name):
    fifo = tmp_path / name
    os.mkfifo(fifo)
    feeder = _feeder(fifo)
    try:
        with pytest.raises(CheckpointError, match=rf"{name} is not a regular file \(a FIFO\): not read"):
            fz.load_weights(state, tmp_path)
    finally:
        _release(fifo, feeder)


def test_a_device_is_refused(state):
    with pytest.raises(CheckpointError, match=r"/dev/zero is not a regular file \(a device\)"):
        fz.load_weights(state, "/dev/zero")


def test_a_file_safetensors_wrote_loads(state, tmp_path):
    """The checks refuse nothing safetensors writes: metadata, and the tensors in any order."""
    want = {"a.weight": torch.arange(4.0).view(2, 2), "a.bias": torch.tensor([5.0, 6.0])}
    save_file(want, tmp_path / "model.safetensors", metadata={"format": "pt", "note": "x"})
    got = fz.full_params(fz.load_weights(state, tmp_path))
    assert all(torch.equal(got[k], v) for k, v in want.items())


def _elsewhere(tmp_path: Path) -> Path:
    out = tmp_path / "elsewhere"
    out.mkdir()
    save_file({"a.weight": torch.full((2, 2), 7.0), "a.bias": torch.full((2,), 7.0)}, out / "secret.safetensors")
    return out / "secret.safetensors"


@pytest.mark.parametrize("indexed", [False, True])
def test_a_shard_leading_out_of_the_folder_is_refused_unread(state, tmp_path, indexed):
    """A downloaded folder may hold a link anywhere: named by the index, or matched by *.safetensors."""
    folder = tmp_path / "hf"
    folder.mkdir()
    name = "model-00001-of-00001.safetensors" if indexed else "model.safetensors"
    (folder / name).symlink_to(_elsewhere(tmp_path))
    if indexed:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a.weight": name,
                                                                                        "a.bias": name}}))
    with pytest.raises(CheckpointError, match=rf"weights file .*{name} leads to .*secret.safetensors, outside the "
                                              "weights folder"):
        fz.load_weights(state, folder)


@pytest.mark.parametrize("indexed", [False, True])
def test_a_hub_cache_snapshot_loads_and_its_links_lead_only_into_its_blobs(state, tmp_path, indexed):
    """snapshot_download's layout, `<repo>/snapshots/<rev>/<file> -> ../../blobs/<hash>`, was refused as
    leading out of the folder; a link of a snapshot's out of its repo's blobs still is."""
    repo = tmp_path / "models--org--net"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    want = {"a.weight": torch.arange(4.0).view(2, 2), "a.bias": torch.tensor([5.0, 6.0])}
    save_file(want, blobs / "f00d")
    name = "model-00001-of-00001.safetensors" if indexed else "model.safetensors"
    (snap / name).symlink_to(Path("..") / ".." / "blobs" / "f00d")
    if indexed:
        (blobs / "beef").write_text(json.dumps({"weight_map": {"a.weight": name, "a.bias": name}}))
        (snap / "model.safetensors.index.json").symlink_to(Path("..") / ".." / "blobs" / "beef")
    got = fz.full_params(fz.load_weights(state, snap))
    assert all(torch.equal(got[k], v) for k, v in want.items())
    (snap / "unet").mkdir()  # a repo's subfolder (diffusers', subfolder=): its links lead one level further up
    (snap / "unet" / "model.safetensors").symlink_to(Path("..") / ".." / ".." / "blobs" / "f00d")
    got = fz.full_params(fz.load_weights(state, snap / "unet"))
    assert all(torch.equal(got[k], v) for k, v in want.items())
    (snap / name).unlink()
    (snap / name).symlink_to(_elsewhere(tmp_path))
    with pytest.raises(CheckpointError, match=rf"{name} leads to .*secret.safetensors, outside the weights folder"):
        fz.load_weights(state, snap)
    # a `blobs` that is itself a link (to /) made any file on the machine one of the repo's blobs
    blobs.rename(repo / "real_blobs")
    blobs.symlink_to("/", target_is_directory=True)
    with pytest.raises(CheckpointError, match=rf"{name} leads to .*secret.safetensors, outside the weights folder"):
        fz.load_weights(state, snap)


@pytest.mark.parametrize("kind", ["fifo", "deep"])
def test_a_config_json_beside_weights_that_do_not_fit_is_read_safely(state, tmp_path, kind):
    """Weights of another shape make fz read the config.json beside them to say why: a FIFO there
    is refused without blocking, 100k-deep JSON is named, not a RecursionError."""
    save_file({"a.weight": torch.zeros(3, 2), "a.bias": torch.zeros(2)}, tmp_path / "model.safetensors")
    said = r"is not a regular file \(a FIFO\): not read" if kind == "fifo" else "nests deeper than Python's"
    cfg = tmp_path / "config.json"
    if kind == "deep":
        cfg.write_text("[" * 100_000 + "]" * 100_000)
    start = time.monotonic()
    with fed_fifo(cfg) if kind == "fifo" else contextlib.nullcontext():
        with pytest.raises(CheckpointError, match=rf"config.json beside the weights {cfg} {said}"):
            fz.load_weights(state, tmp_path)
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("name", ["a" * 5000 + ".safetensors", "a\x00.safetensors"])
def test_an_index_naming_no_possible_file_is_refused(state, tmp_path, name):
    """A shard name over 255 bytes was a raw OSError(ENAMETOOLONG) from f.exists(): now named."""
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a.weight": name}}))
    with pytest.raises(CheckpointError, match="not a .safetensors file in the folder"):
        fz.load_weights(state, folder)


def test_a_shape_of_a_million_dimensions_is_refused_in_a_line(state, tmp_path):
    """A shape of 10**6 ones (4 bytes of data) made a 6 MB error, the shape printed twice."""
    _write(tmp_path / "model.safetensors", {"a.weight": _t(0, 4, (1,) * 10**6)}, b"\0" * 4)
    with pytest.raises(CheckpointError, match=r"tensor 'a.weight' has a shape of 1000000 dimensions, over 64") as e:
        fz.load_weights(state, tmp_path)
    assert len(str(e.value)) < 1000
