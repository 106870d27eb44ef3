"""A full offload directory during an async save (issue 27, item 7): the snapshot's room is
checked before it starts, and a disk that fills during it is the same CheckpointError, naming
the directory and the space needed; the last good checkpoint stays intact and restores."""
from __future__ import annotations

import errno
import re
import shutil
from collections import namedtuple

import pytest

import fz
from fz.ckpt import restore, save, wait_for_checkpoints
from fz.storage.disk import DiskTensor

from support.helpers import make_model, spec

Usage = namedtuple("Usage", "total used free")


def _state(nvme):
    nvme.mkdir()
    return fz.init(make_model(), spec(2, 1, offload=fz.offload.nvme(str(nvme), buffer_mb=0.05, buffers=2,
                                                                      prefetch=1)))


def _intact(root, state):
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2"]
    assert (root / "latest").read_text().startswith("step_2 ")
    back = restore(fz.init(make_model(), spec(2, 1)), root)
    assert all(bool((a == b).all()) for a, b in zip(fz.full_params(back).values(),
                                                    fz.full_params(state).values()))


def test_async_save_checks_the_offload_directorys_room_before_the_snapshot(tmp_path, monkeypatch):
    nvme, root = tmp_path / "nvme", tmp_path / "ck"
    state = _state(nvme)
    save(state, root, step=2)
    real = shutil.disk_usage

    def full_offload_disk(path):
        u = real(path)
        return Usage(u.total, u.total - 4096, 4096) if str(path).startswith(str(nvme)) else u

    copies = []
    monkeypatch.setattr(shutil, "disk_usage", full_offload_disk)
    monkeypatch.setattr(DiskTensor, "copy_to_new_blob", lambda self: copies.append(self))
    with pytest.raises(fz.CheckpointError, match=re.escape(f"async save of checkpoint {root / 'step_4'}: the "
                                                           f"offload directory {nvme}/fz-offload-") +
                       r"[^ ]+ has 0\.0 MiB free; the snapshot of this rank's offloaded state needs [\d.]+ MiB "
                       r"there \(an async save copies it before training goes on\)\. Free space there, give "
                       r"fz\.offload\.nvme a larger disk, or save with async_=False"):
        save(state, root, step=4, async_=True)
    wait_for_checkpoints()
    assert copies == []  # checked before the snapshot started
    _intact(root, state)
    save(state, root, step=4)  # a sync save reads the offloaded state in place: no snapshot, no check
    assert (root / "latest").read_text().startswith("step_4 ")


def test_a_disk_that_fills_during_the_snapshot_is_the_same_error(tmp_path, monkeypatch):
    nvme, root = tmp_path / "nvme", tmp_path / "ck"
    state = _state(nvme)
    save(state, root, step=2)

    def enospc(self):
        raise OSError(errno.ENOSPC, f"offload write of {self._blob.store.dir}/clone-9.bin at byte 0: "
                                    "No space left on device")

    monkeypatch.setattr(DiskTensor, "copy_to_new_blob", enospc)
    with fz.Checkpointer(root, async_=True) as ckpt:
        with pytest.raises(fz.CheckpointError, match=r"async save of checkpoint .*step_4: the offload directory "
                                                     + re.escape(str(nvme)) + r"/fz-offload-[^ ]+ is full; the "
                                                     r"snapshot of this rank's offloaded state needs [\d.]+ MiB"):
            ckpt.save(state, step=4)
    _intact(root, state)
