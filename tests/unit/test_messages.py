"""Messages say what happened: an empty batch, which checkpoint file could not be read, a full disk."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem

import fz
from fz.ckpt import manifest
from fz.cli import main
from fz.errors import ConfigError

from support.helpers import make_model, rank_batches, spec


def test_an_empty_batch_says_it_is_empty():
    state = fz.init(make_model(), spec(0, 2))
    empty = torch.zeros(0, 17, dtype=torch.long)
    with pytest.raises(ConfigError, match=r"the batch is empty \(0 rows\)"):
        fz.train_step(state, empty)
    with pytest.raises(ConfigError, match=r"fz.eval_step: the batch is empty"):
        fz.eval_step(state, empty)
    with pytest.raises(ConfigError, match=r"the batch is empty \(4 rows and no elements\)"):
        fz.train_step(state, {"tokens": torch.zeros(4, 0, dtype=torch.long)})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("msg")
    state = fz.init(make_model(), spec(0, 1))
    state, _ = fz.train_step(state, rank_batches(1, 1, 1)[0][0])
    fz.save(state, root / "ck")
    return root / "ck" / "step_1"


def _garbled_copy(src, dst, name: str, data: bytes = b"{not json, not a pickle"):
    """A copy of checkpoint `src` whose file `name` is not what it should be, with a manifest that
    agrees (as if it had been written that way): only reading the file can find it."""
    shutil.copytree(src, dst)
    (dst / name).write_bytes(data)
    files = manifest.read(dst)
    files.update(manifest.describe(dst, [name]))
    manifest.write(dst, files)
    return dst


@pytest.mark.parametrize("name", ["fz.json", "data_0.json", "index.json", "__0_0.distcp"])
def test_every_unreadable_checkpoint_file_is_named(saved, tmp_path, name):
    bad = _garbled_copy(saved, tmp_path / "step_1", name)
    with pytest.raises(ConfigError) as e:
        fz.restore(fz.init(make_model(), spec(0, 1)), bad)
    assert f"checkpoint file {bad / name} is unreadable" in str(e.value), str(e.value)


def test_fz_consolidate_names_an_unparsable_fz_json_without_a_traceback(saved, tmp_path, capsys):
    bad = _garbled_copy(saved, tmp_path / "step_1", "fz.json")
    assert main(["consolidate", str(bad), str(tmp_path / "out.safetensors")]) == 2
    err = capsys.readouterr().err
    assert f"fz consolidate: error: checkpoint file {bad / 'fz.json'} is unreadable" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("shape", ["list", "buffers_int", "buffers_lists", "bytes_str", "escapes"])
def test_fz_inspect_and_consolidate_name_an_fz_json_of_the_wrong_shape(saved, tmp_path, capsys, shape):
    """Valid JSON of the wrong shape in fz.json: the file and the field named, not an AttributeError or
    TypeError traceback (inspect shows the facts it could read, a wrong-typed one as unknown)."""
    meta = json.loads((saved / "fz.json").read_text())
    meta = {"list": [1], "buffers_int": {**meta, "state_dict_buffers": 5},
            "buffers_lists": {**meta, "state_dict_buffers": [[1]]}, "bytes_str": {**meta, "bytes": "x"},
            # a terminal's control codes: a window title, a cleared screen, a fake verdict
            "escapes": {**meta, "fz_version": "0.1\x1b]0;T\x07\x1b[2J\x1b[31mverified OK\x1b[0m"}}[shape]
    bad = _garbled_copy(saved, tmp_path / "step_1", "fz.json", json.dumps(meta).encode())
    words = {"list": "it is a JSON list, not an object", "bytes_str": "bytes is 'x', not int",
             "escapes": re.escape(r"fz_version is '0.1\x1b]0;T\x07\x1b[2J") + ".*, not str of up to 64 printable "
                        "characters"}.get(
        shape, r"its state_dict_buffers is \S+, not a list of buffer names")
    assert main(["inspect", str(bad)]) == 1
    out = capsys.readouterr().out
    assert re.search(rf"metadata +UNREADABLE: checkpoint file {re.escape(str(bad / 'fz.json'))} is damaged: {words}",
                     out), out
    assert "\x1b" not in out
    fields_read = shape in ("bytes_str", "escapes")
    assert bool(re.search(r"^train step +1$", out, re.M)) == fields_read  # the facts it could read
    assert main(["consolidate", str(bad), str(tmp_path / "out.safetensors")]) == (0 if fields_read else 2)
    err = capsys.readouterr().err
    assert "Traceback" not in err and (fields_read or re.search(
        rf"fz consolidate: error: checkpoint file {re.escape(str(bad / 'fz.json'))} is damaged: {words}", err)), err


def test_a_write_that_fails_on_a_full_disk_says_the_disk_is_full(tmp_path, monkeypatch):
    """torch.save on a full disk fails as "unexpected pos": the free space says why."""
    state = fz.init(make_model(), spec(0, 1))

    def torn(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos 704 vs 598")

    monkeypatch.setattr(dcp_filesystem, "_write_item", torn)
    with pytest.raises(fz.CheckpointError) as roomy:
        fz.save(state, tmp_path / "roomy")
    assert "unexpected pos 704 vs 598" in str(roomy.value) and "disk is full" not in str(roomy.value)

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))
    with pytest.raises(fz.CheckpointError) as full:
        fz.save(state, tmp_path / "full")
    msg = str(full.value)
    assert msg.startswith("the disk is full (1.0 MiB free of "), msg
    assert str(tmp_path / "full" / "step_0.tmp") in msg and "unexpected pos 704 vs 598" in msg, msg


def test_fz_consolidate_names_an_output_it_cannot_write_before_reading(saved, tmp_path, capsys, monkeypatch):
    """A folder given as the output file was found only after the whole file was written; a
    missing folder or a read-only one was a raw OSError traceback (exit 1). Each is one line, exit 2."""
    import errno
    import os
    (tmp_path / "a_folder").mkdir()
    for out, words in ((tmp_path / "a_folder", "is a folder: give a file name"),
                       (tmp_path / "no" / "x.safetensors", "the folder .*no does not exist")):
        assert main(["consolidate", str(saved), str(out)]) == 2
        assert re.search(r"^fz consolidate: error: .*" + words, capsys.readouterr().err)
    monkeypatch.setattr(os, "access", lambda *a, **k: False)  # as on a read-only mount (we may run as root)
    assert main(["consolidate", str(saved), str(tmp_path / "x.safetensors")]) == 2
    assert "is not writable (permissions, or a read-only filesystem)" in capsys.readouterr().err
    monkeypatch.undo()

    def read_only(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "x.safetensors.tmp"))
    monkeypatch.setattr("fz.ckpt.hf.safetensors_io.open_fresh", read_only)
    assert main(["consolidate", str(saved), str(tmp_path / "x.safetensors")]) == 2
    assert capsys.readouterr().err.startswith("fz consolidate: error: Read-only file system: ")


def test_ctrl_c_during_a_save_is_a_keyboard_interrupt_and_loses_nothing(tmp_path, monkeypatch):
    """DCP catches the KeyboardInterrupt of its write and reports it as a failure: it surfaced as a
    CheckpointError (exit 1, `except KeyboardInterrupt` missed it). The last good step stays."""
    state = fz.init(make_model(), spec(0, 1))
    fz.save(state, tmp_path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dcp_filesystem, "_write_item", interrupted)
    state, _ = fz.train_step(state, rank_batches(1, 1, 1)[0][0])
    with pytest.raises(KeyboardInterrupt):
        fz.save(state, tmp_path)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == ["step_0"]
    assert int(fz.restore(fz.init(make_model(), spec(0, 1)), tmp_path).step) == 0
