"""The NVMe tier's directory is often shared (/tmp, a scratch disk): before it writes, fz removes the
run directories a gone process of this host left (`fz-offload-*` with an `owner` file). What
others put there is read without following a link, without blocking and within a size: a link
named like a run directory is left alone (its target too), a FIFO or a huge `owner` is not read,
and an owner naming an impossible pid is not taken for a gone run."""
from __future__ import annotations

import json
import os
import socket

import pytest

from fz.storage import store

from support.ds_hostile import within

DEAD = 2**22 + 12345  # above Linux's largest pid: no such process


def _run_dir(root, name: str, owner: object | None = None):
    d = root / name
    d.mkdir()
    if owner is not None:
        (d / "owner").write_text(json.dumps(owner))
    (d / "opt-0.bin").write_bytes(b"\0" * 16)
    return d


def test_a_gone_runs_directory_is_removed_and_nothing_else(tmp_path):
    root, outside = tmp_path / "shared", tmp_path / "victim"
    root.mkdir()
    gone = _run_dir(root, "fz-offload-a", {"host": socket.gethostname(), "pid": DEAD})
    alive = _run_dir(root, "fz-offload-b", {"host": socket.gethostname(), "pid": os.getpid()})
    other_host = _run_dir(root, "fz-offload-c", {"host": "elsewhere", "pid": DEAD})
    # a link named like a run directory, to a folder that looks gone: neither followed nor removed
    target = _run_dir(tmp_path, "victim", {"host": socket.gethostname(), "pid": DEAD})
    (root / "fz-offload-link").symlink_to(outside)
    # owners that are no pid: huge, negative, a bool, a string
    odd = [_run_dir(root, f"fz-offload-pid{i}", {"host": socket.gethostname(), "pid": pid})
           for i, pid in enumerate([2**70, -1, True, "12"])]
    with pytest.warns(UserWarning, match="fz-offload-a was left by a run that is gone"):
        store._remove_stale(str(root))
    assert not gone.exists()
    assert alive.exists() and other_host.exists() and all(d.exists() for d in odd)
    assert (root / "fz-offload-link").is_symlink() and (target / "opt-0.bin").exists()


@pytest.mark.parametrize("kind", ["fifo", "huge", "link"])
def test_an_owner_file_that_is_no_small_regular_file_is_not_read(kind, tmp_path):
    """A FIFO with no writer would block the run's start forever (here: ds_hostile's Hung after 60 s);
    a huge file would be read whole; a link reads a file elsewhere, which here names a gone run."""
    root = tmp_path / "shared"
    root.mkdir()
    d = _run_dir(root, "fz-offload-x")
    elsewhere = tmp_path / "owner.json"
    elsewhere.write_text(json.dumps({"host": socket.gethostname(), "pid": DEAD}))
    if kind == "fifo":
        os.mkfifo(d / "owner")
    elif kind == "huge":
        (d / "owner").write_text(json.dumps({"host": socket.gethostname(), "pid": DEAD, "pad": "x" * 10**6}))
    else:
        (d / "owner").symlink_to(elsewhere)
    with within(60):
        store._remove_stale(str(root))
    assert d.exists() and (d / "opt-0.bin").exists()  # not taken for a gone run
