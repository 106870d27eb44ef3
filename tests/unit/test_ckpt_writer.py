"""fz/ckpt/writer.py: the files a save writes (O_DIRECT and not) hold exactly the bytes given,
their recorded checksums are what a read-back computes, a failed write is an error, and
checkpoints whose manifest lists crc32 (written before issue 26) still verify and restore."""
from __future__ import annotations

import errno
import json
import os
import random
from pathlib import Path

import pytest
import torch

import fz
from fz.ckpt import manifest, restore, save, wait_for_checkpoints, writer
from fz.ckpt.writer import BUFFER, HashingFile

from support.helpers import train_fz

SIZES = [0, 1, 4095, 4096, 4097, BUFFER - 1, BUFFER, BUFFER + 1, 2 * BUFFER + 12345]


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("algorithm", manifest.ALGORITHMS)
def test_a_file_holds_the_bytes_written_and_its_checksum_is_the_read_backs(tmp_path, algorithm, direct, monkeypatch):
    if not direct:
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
    rng = random.Random(0)
    for d in [tmp_path]:
        for size in SIZES:
            data = rng.randbytes(size)
            p = d / f"f{size}.bin"
            f = HashingFile(p, algorithm)
            assert f.direct == (direct and hasattr(os, "O_DIRECT"))
            at = 0
            while at < size:  # pieces of every size, as torch.save writes them
                k = rng.choice([1, 64, 5000, BUFFER // 3, BUFFER + 7])
                assert f.write(memoryview(data)[at:at + k]) == min(k, size - at)
                at += k
                assert f.tell() == min(at, size)
            os.fsync(f.fileno())
            f.close()
            assert p.read_bytes() == data
            assert f.digest() == manifest.file_checksum(p, algorithm)


def test_a_filesystem_that_refuses_o_direct_gets_buffered_writes(tmp_path, monkeypatch):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT here")
    real = os.open

    def refuse(path, flags, mode=0o777):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, mode)
    monkeypatch.setattr(os, "open", refuse)
    f = HashingFile(tmp_path / "x.bin", "xxh3")
    f.write(b"abc" * 5000)
    f.close()
    assert not f.direct and (tmp_path / "x.bin").read_bytes() == b"abc" * 5000


def test_a_failed_background_write_is_the_callers_error(tmp_path, monkeypatch):
    def enospc(fd, view):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(writer, "_write_all", enospc)
    f = HashingFile(tmp_path / "x.bin", "xxh3")
    with pytest.raises(OSError, match="No space"):
        f.write(bytes(3 * BUFFER))  # the second full buffer waits for the first's write
    f.abort()
    assert f.closed


def test_a_crc32_checkpoint_verifies_restores_and_catches_damage(tmp_path, monkeypatch):
    state, _ = train_fz(0, 1, 3, 1, steps=2)
    want = fz.full_params(state)
    monkeypatch.setattr(manifest, "ALGORITHM", "crc32")  # what fz wrote before issue 26
    save(state, tmp_path / "ck", step=2)
    monkeypatch.undo()
    d = tmp_path / "ck" / "step_2"
    files = json.loads((d / "manifest.json").read_text())["files"]
    assert {v["algorithm"] for v in files.values()} == {"crc32"}
    manifest.verify(d)
    fresh, _ = train_fz(0, 1, 3, 1, steps=0)
    got = fz.full_params(restore(fresh, tmp_path / "ck"))
    assert all(torch.equal(got[k], want[k]) for k in want)
    with open(d / "__0_0.distcp", "r+b") as f:
        f.seek(5000)
        b = f.read(1)
        f.seek(5000)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(fz.CheckpointError, match="corrupted: crc32"):
        manifest.verify(d)


@pytest.mark.parametrize("async_", [False, True])
def test_new_checkpoints_list_xxh3_taken_while_writing(tmp_path, monkeypatch, async_):
    state, _ = train_fz(0, 1, 3, 1, steps=1)
    reads = []
    real = manifest.file_checksum
    monkeypatch.setattr(manifest, "file_checksum", lambda p, *a, **k: reads.append(Path(p).name) or real(p, *a, **k))
    save(state, tmp_path / "ck", step=1, async_=async_)
    wait_for_checkpoints()
    assert not [n for n in reads if n.endswith(".distcp")], reads  # no data file is read back
    files = manifest.verify(tmp_path / "ck" / "step_1")
    assert {v["algorithm"] for k, v in files.items() if k.endswith(".distcp")} == {"xxh3"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_a_bucket_view_is_written_from_its_own_memory_not_a_copy(dtype):
    from fz.ckpt.saver import _owning
    bucket = (torch.randn(1000) * 3).to(dtype)
    view = bucket[100:300].view(20, 10)
    alias = _owning(view)
    assert alias.data_ptr() == view.data_ptr() and torch.equal(alias, view) and alias.shape == view.shape
    assert alias.untyped_storage().nbytes() == view.numel() * view.element_size()  # DCP then writes it as is
    assert _owning(bucket) is bucket and _owning(bucket[::2]) is not None
