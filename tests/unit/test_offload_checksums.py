"""The NVMe tier reads back what it wrote, or says which file changed (fz/storage/checksum.py).

A changed byte in an offload file between steps (a bit flip, random bytes, NaNs) is an
fz.OffloadError naming the file, from the step and from fz.save; the last checkpoint stays
whole and restores. The checks hold for reads and writes at any offset, and for I/O
threads writing neighbouring ranges of one file at once.
"""
from __future__ import annotations

import os
import random
import struct

import pytest
import torch
import torch.utils._pytree as pytree

import fz
from fz.storage.checksum import BLOCK, table_bytes
from fz.storage.disk import DiskTensor
from fz.storage.io import IOPool
from fz.storage.store import DiskStore

from support.helpers import make_model, rank_batches, spec

DAMAGE = {
    "bit": lambda old: bytes([old[0] ^ 0x10]) + old[1:],
    "random": lambda old: random.Random(1).randbytes(len(old)),
    "nan": lambda old: struct.pack("<f", float("nan")) * (len(old) // 4),
}


def _damage(path: str, at: int, how: str, n: int = 64) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        old = f.read(n)
        f.seek(at)
        f.write(DAMAGE[how](old))


def test_reads_at_any_offset_return_what_was_written(tmp_path):
    store = DiskStore(str(tmp_path), direct=True)
    n = 5 * BLOCK + 12345  # a short last block
    blob, want = store.new_blob("t", n), torch.zeros(n, dtype=torch.uint8)
    rng = random.Random(0)
    for _ in range(100):
        a = rng.randrange(n)
        k = rng.randrange(1, min(n - a, 3 * BLOCK) + 1)
        data = torch.randint(0, 256, (k,), dtype=torch.uint8)
        blob.write(((a, k),), data)
        want[a:a + k] = data
        a = rng.randrange(n)
        k = rng.randrange(1, n - a + 1)
        assert torch.equal(blob.read(((a, k),)), want[a:a + k])
    assert torch.equal(blob.read(((0, n),)), want)
    assert blob.sums.table_bytes == table_bytes(n) == 8 * 6  # 8 bytes per 64 KiB block


def test_threads_writing_neighbouring_ranges_keep_every_sum(tmp_path):
    store = DiskStore(str(tmp_path), direct=True)
    group = 24 * 4096  # groups start on 4 KiB boundaries, inside 64 KiB blocks: neighbours share a block
    n = 64 * group
    blob, want = store.new_blob("u", n), torch.randint(0, 256, (n,), dtype=torch.uint8)
    pool = IOPool(8, group, 4, store.direct, False)
    for first in range(0, n, 8 * group):
        writes = []
        for buf, at in zip(pool.buffers, range(first, min(n, first + 8 * group), group)):
            buf.copy_(want[at:at + group])
            writes.append(pool.write(blob, at, group, buf))
        for w in writes:
            w.result()
    pool.read(blob, 5 * group, group, pool.buffers[0]).result()
    assert torch.equal(pool.buffers[0], want[5 * group:6 * group])
    assert torch.equal(blob.read(((0, n),)), want)
    _damage(blob.path, 7 * group + 100, "bit", 1)
    with pytest.raises(fz.OffloadError, match=rf"offload file {blob.path}: bytes \d+-\d+ changed on disk"):
        pool.read(blob, 7 * group, group, pool.buffers[0]).result()
    with pytest.raises(fz.OffloadError, match="restore from the last checkpoint"):
        blob.read(((7 * group + 99, 3),))  # a read of a few bytes checks their whole block
    pool.close()


def _disk_files(state) -> dict[str, list[str]]:
    """{'param'|'opt': paths of the files the state's leaves live in}."""
    leaves = [f._local_tensor for f in state.param_flats] + [f._local_tensor for f in state.master_flats.values()]
    leaves += [x._local_tensor for x in pytree.tree_leaves(state.opt_state) if hasattr(x, "_local_tensor")]
    out: dict[str, list[str]] = {}
    for t in leaves:
        if isinstance(t, DiskTensor):
            kind = os.path.basename(t._blob.path).split("-")[0]
            out.setdefault(kind, [])
            if t._blob.path not in out[kind]:
                out[kind].append(t._blob.path)
    return out


@pytest.mark.parametrize("kind,how", [("opt", "bit"), ("opt", "nan"), ("param", "random")])
def test_a_changed_offload_file_stops_training_and_the_checkpoint_stays_whole(tmp_path, kind, how):
    batches = [b[0] for b in rank_batches(1, 1, 4)]
    sp = spec(3, 1, nonfinite="skip", offload=fz.offload.nvme(str(tmp_path), params=True, buffer_mb=0.2, buffers=3))
    state = fz.init(make_model(), sp)
    state, _ = fz.train_step(state, batches[0])
    fz.save(state, tmp_path / "ckpt", verbose=False)
    saved = {k: v.clone() for k, v in fz.full_params(state).items()}
    state, _ = fz.train_step(state, batches[1])
    state = fz.block_until_ready(state)  # the update no longer streams into the files (fz/step/pending.py)
    files = _disk_files(state)
    assert set(files) == {"opt", "param"}
    path = files[kind][-1]
    _damage(path, os.path.getsize(path) // 2, how)
    with pytest.raises(fz.CheckpointError, match=f"failed: rank 0: OffloadError: .*offload file {path}: bytes"):
        fz.save(state, tmp_path / "ckpt", verbose=False)  # a save reads every file: it stops before the commit
    with pytest.raises(fz.OffloadError, match=f"offload file {path}"):
        fz.train_step(state, batches[2], donate=False)
    assert (tmp_path / "ckpt" / "latest").read_text().startswith("step_1 ")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step_1"]
    back = fz.restore(fz.init(make_model(), sp), tmp_path / "ckpt", verbose=False)
    for k, v in fz.full_params(back).items():
        assert torch.equal(v, saved[k]), k
    _, loss = fz.train_step(back, batches[1])
    assert torch.isfinite(loss)


def test_memory_report_measures_the_tables_and_the_estimate_predicts_them(tmp_path):
    sp = spec(3, 1, offload=fz.offload.nvme(str(tmp_path), params=True, buffer_mb=0.2, buffers=3))
    state = fz.init(make_model(), sp)
    files = [p for ps in _disk_files(state).values() for p in ps]
    measured = fz.memory_report(state).tiers["host"]["checksums"]
    assert measured == sum(table_bytes(os.path.getsize(p)) for p in files) > 0
    assert fz.estimate(make_model(), spec=sp).tiers["host"]["checksums"] == measured


@pytest.mark.parametrize("swap", ["fifo", "link", "truncated"])
def test_an_offload_file_replaced_or_truncated_is_an_offload_error_at_once(tmp_path, swap):
    """A FIFO in a blob's place blocked the next read forever; a link was followed; a truncated file
    was a bare OSError. Each is an OffloadError naming the file, without waiting."""
    store = DiskStore(str(tmp_path), direct=False)
    blob = store.new_blob("t", 4 * BLOCK)
    blob.write(((0, 4 * BLOCK),), torch.ones(4 * BLOCK, dtype=torch.uint8))
    os.unlink(blob.path)
    if swap == "fifo":
        os.mkfifo(blob.path)
        said = "was replaced by something that is not a regular file"
    elif swap == "link":
        (tmp_path / "elsewhere").write_bytes(bytes(4 * BLOCK))
        os.symlink(tmp_path / "elsewhere", blob.path)
        said = "was replaced by a link: not followed"
    else:
        with open(blob.path, "wb") as f:
            f.write(bytes(BLOCK))
        said = "the file ends early"
    with pytest.raises(fz.OffloadError, match=said):
        blob.read(((0, 4 * BLOCK),))
    pool = IOPool(1, 4 * BLOCK, 1, direct=False, pin=False)
    with pytest.raises(fz.OffloadError, match=said):
        pool.read(blob, 0, 4 * BLOCK, pool.buffers[0]).result(timeout=60)
    pool.close()
