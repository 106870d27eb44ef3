"""fz/storage/scratch.py: a kept buffer is handed out again only once nothing else uses it."""
from __future__ import annotations

import torch

from fz.storage.scratch import Scratch

N = 1 << 20


def test_a_buffer_is_reused_only_when_nothing_else_holds_it():
    pool = Scratch(enabled=True)
    a = pool.empty(N, torch.float32)
    b = pool.empty(N, torch.float32)
    assert a.data_ptr() != b.data_ptr()  # both in use
    pa = a.data_ptr()
    del a
    c = pool.empty(N, torch.float32)
    assert c.data_ptr() == pa  # reused: no new mapping
    for hold in (lambda t: t[5:], lambda t: t.view(4, -1), lambda t: t.numpy(), lambda t: t.to(torch.float32)):
        fresh = Scratch(enabled=True)
        t = fresh.empty(N, torch.float32)
        kept, ptr = hold(t), t.data_ptr()
        del t
        assert fresh.empty(N, torch.float32).data_ptr() != ptr, hold  # still in use: never handed out twice
        del kept
        assert fresh.empty(N, torch.float32).data_ptr() == ptr, hold  # now free

def test_autograd_and_collectives_hold_a_buffer():
    pool = Scratch(enabled=True)
    w = torch.randn(8, requires_grad=True)
    buf = pool.empty(N, torch.float32).fill_(1.0)
    loss = (buf[:8] * w).sum()  # autograd saves the view
    ptr = buf.data_ptr()
    del buf
    assert pool.empty(N, torch.float32).data_ptr() != ptr
    loss.backward()
    del loss
    other = pool.empty(N, torch.float32)  # the saved view is gone: one of the two is free again
    assert other.data_ptr() in {ptr} | {t.data_ptr() for ts in pool.kept.values() for t in ts}


def test_trim_lets_go_of_idle_buffers_only():
    pool = Scratch(enabled=True)
    used = pool.empty(N, torch.float32)
    idle = pool.empty(N, torch.float32)
    del idle
    assert pool.kept_bytes == 2 * N * 4
    pool.trim()
    assert pool.kept_bytes == N * 4 and used.data_ptr() == pool.kept[(N, torch.float32)][0].data_ptr()
    assert pool.empty(1000, torch.float32).numel() == 1000  # small ones: plain memory, not kept
    assert pool.kept_bytes == N * 4


def test_off_until_enabled():
    """Off by default (glibc's heap already reuses freed memory): on only where fz pins glibc's mmap
    threshold, the disk tier's store (fz/storage/store.py)."""
    pool = Scratch()
    a = pool.empty(N, torch.float32)
    del a
    assert pool.kept_bytes == 0
    pool.enable()
    pool.empty(N, torch.float32)
    assert pool.kept_bytes == N * 4
