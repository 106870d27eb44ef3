"""fz/storage/scratch.py: a kept buffer is handed out again only once nothing else uses it."""
from __future__ import annotations

import torch

from fz.storage.scratch import FIT, GRAIN, IDLE_CAP, Scratch

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
    assert pool.kept_bytes == N * 4 and used.data_ptr() == pool.kept[Scratch.size_of(N, torch.float32)][0].data_ptr()
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


def test_idle_buffers_are_bounded_before_new_memory_is_mapped():
    """What idle buffers may add to a peak is what fz.estimate counts (`pool_idle`): IDLE_CAP times
    the largest kept buffer, the sizes asked for least recently let go first when new memory is needed."""
    pool = Scratch(enabled=True)
    held = pool.empty(N // 2, torch.float32)
    sizes = [N + k * GRAIN // 4 for k in range(1, 2 * IDLE_CAP + 3)]  # elements: idle, they are more than the bound
    idle = [pool.empty(n, torch.float32) for n in sizes]
    del idle
    assert pool.kept_bytes == sum(Scratch.size_of(n, torch.float32) for n in [N // 2, *sizes])  # nothing new mapped
    again = pool.empty(sizes[0], torch.float32)  # asked for again: now the most recent size
    del again
    fresh = pool.empty(8 * N, torch.float32)  # larger than any kept one: new memory, so idle ones go first
    in_use = Scratch.size_of(held.numel(), torch.float32) + Scratch.size_of(fresh.numel(), torch.float32)
    idle_bytes = pool.kept_bytes - in_use
    largest = Scratch.size_of(fresh.numel(), torch.float32)
    assert 0 < idle_bytes <= IDLE_CAP * largest
    assert Scratch.size_of(sizes[0], torch.float32) in pool.kept  # asked for last: stays
    assert Scratch.size_of(sizes[1], torch.float32) not in pool.kept  # least recent: went
    kept = pool.kept[Scratch.size_of(sizes[-1], torch.float32)][0].data_ptr()
    assert pool.empty(sizes[-1], torch.float32).data_ptr() == kept  # a kept idle one is handed out again
    del fresh


def test_one_kept_size_serves_every_dtype():
    """A step's fp32 shard and bf16 bucket of the same bytes share one kept buffer."""
    pool = Scratch(enabled=True)
    a = pool.empty(N, torch.float32)
    ptr = a.data_ptr()
    del a
    b = pool.empty(2 * N, torch.bfloat16)
    assert b.data_ptr() == ptr and b.dtype == torch.bfloat16 and b.numel() == 2 * N
    assert pool.kept_bytes == Scratch.size_of(N, torch.float32)


def test_an_idle_buffer_a_little_larger_serves_a_request():
    """A step's buckets differ in size: an idle buffer up to FIT times a request serves it."""
    pool = Scratch(enabled=True)
    a = pool.empty(3 * N // 2, torch.float32)  # 6 MiB
    ptr = a.data_ptr()
    del a
    small = pool.empty(N // 2, torch.float32)  # 2 MiB: 6 MiB is more than FIT times it
    assert small.data_ptr() != ptr
    b = pool.empty(N + N // 4, torch.float32)  # 5 MiB, rounded to 6: the kept one
    assert b.data_ptr() == ptr and b.numel() == N + N // 4
    assert Scratch.size_of(3 * N // 2, torch.float32) <= FIT * Scratch.size_of(N, torch.float32)
    c = pool.empty(N, torch.float32)  # 4 MiB: the 6 MiB one would serve it, but b holds it
    assert c.data_ptr() != ptr


def test_backward_computes_large_weight_gradients_into_the_pool(monkeypatch):
    """fz.step.pooled_backward: linear layers' weight gradients land in the pool's buffers (same
    values as without it), layer after layer in the same buffer; only sizes the pool already
    keeps (its idle bound must not grow), only on the CPU, only while the pool is on."""
    import contextlib

    from fz.step import pooled_backward as pb
    pool = Scratch(enabled=True)
    monkeypatch.setattr(pb, "SCRATCH", pool)
    torch.manual_seed(0)
    lins = [torch.nn.Linear(1024, 2048).bfloat16() for _ in range(3)]
    x = torch.randn(64, 1024).bfloat16()

    def grads(hold):
        seen = []

        def take(p):  # each gradient dropped once taken, as a bucket's reduction does
            seen.append((p.grad.clone(), p.grad.data_ptr()))
            p.grad = None

        for layer in lins:
            layer.weight.register_post_accumulate_grad_hook(take)
        with hold():
            sum(layer(x).float().sum() for layer in lins).backward()
        for layer in lins:
            layer.weight._post_accumulate_grad_hooks.clear()
        return seen

    plain = grads(contextlib.nullcontext)
    assert not {ptr for _, ptr in grads(pb.pooled_backward)} & {t.data_ptr() for ts in pool.kept.values() for t in ts}
    assert not pool.kept  # nothing kept yet: a 4 MiB gradient would raise the idle bound
    pool.empty(2048 * 1024 * 2, torch.uint8)  # the step's buckets: a kept 4 MiB buffer, idle at once
    pooled = grads(pb.pooled_backward)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(plain, pooled))
    kept = {t.data_ptr() for ts in pool.kept.values() for t in ts}
    assert {ptr for _, ptr in pooled} <= kept
    assert len({ptr for _, ptr in pooled}) == 1  # each layer's gradient reused the last one's buffer
    for off in (lambda: pb.pooled_backward("meta"), lambda: pb.pooled_backward(compiled=True)):
        assert not {ptr for _, ptr in grads(off)} & kept  # not for another device, nor compiled blocks
    pool.enabled = False  # off (no disk tier): no dispatch mode, plain memory
    assert not {ptr for _, ptr in grads(pb.pooled_backward)} & kept
