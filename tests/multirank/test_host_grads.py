"""Offloaded optimizer: gradients leave the device as buckets are reduced (fz/offload/host_grads.py).

On this CPU host and device are one memory, so the test tracks the device-tier buffers
themselves: every reduced gradient handed to the host copy must be dead once the copy
is done (weak references), no device-tier accumulator or `.grad` may exist after
backward, and the update must read fp32 buffers distinct from them. Accumulation over
micro-batches on the host is exact in fp32 and within bf16's rounding otherwise.
"""
from __future__ import annotations

import weakref

import pytest
import torch

import fz
from fz.testing.spawn import run_ranks

from support.helpers import make_model, params_rel, rank_batches, spec

CASES = [(1, "cpu", "bf16", 1), (2, "cpu", "fp32", 2), (2, "nvme", "bf16", 1), (3, "cpu", "bf16", 2),
         (3, "cpu-params", "fp32", 1), (3, "nvme-params", "bf16", 2)]


def _policy(kind, path):
    import os
    os.makedirs(path, exist_ok=True)
    if kind.startswith("cpu"):
        return fz.offload.cpu(params=kind.endswith("params"))
    return fz.offload.nvme(path, params=kind.endswith("params"), buffer_mb=0.05, buffers=3)


def _watch(rank, world, root):
    import fz.offload.host_grads as hg
    import fz.step.grads as gr

    seen = {"handed": 0, "alive_after_copy": 0, "device_acc": 0, "leaf_grads": 0, "host_ptrs_shared": 0}
    refs = []
    add, end = hg.HostGrads.add, gr.GradReducer.end_micro_batch

    def watched_add(self, index, out):
        seen["handed"] += 1
        refs.append(weakref.ref(out))
        add(self, index, out)
        acc = self.acc.get(index)  # where no copy is in flight, the host buffer: never the device's storage
        seen["host_ptrs_shared"] += (
            acc is not None and acc.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
        )
        if acc is not None:
            step_ptrs[-1].add(acc.untyped_storage().data_ptr())

    def watched_end(self):
        end(self)
        if self.host is None:  # the in-memory run beside it
            return
        seen["device_acc"] += len(self.acc)
        seen["leaf_grads"] += sum(leaf.grad is not None for leaf in self.leaves)

    hg.HostGrads.add, gr.GradReducer.end_micro_batch = watched_add, watched_end
    out = {}
    step_ptrs: list[set[int]] = []  # the host gradient buffers each step of the offloaded state used
    for stage, kind, precision, accum in CASES:
        batches = rank_batches(world, accum, 3)
        plain = fz.init(make_model(), spec(stage, accum, precision=precision))
        state = fz.init(make_model(), spec(stage, accum, precision=precision,
                                           offload=_policy(kind, f"{root}/{stage}{kind}{precision}{rank}")))
        want, got = [], []
        del step_ptrs[:]
        for b in batches:
            plain, lw = fz.train_step(plain, b[rank])
            before = len(refs)
            step_ptrs.append(set())
            state, lg = fz.train_step(state, b[rank])
            fz.block_until_ready(state)  # a streamed update gives its buffers back once done
            seen["alive_after_copy"] += sum(r() is not None for r in refs[before:])
            want.append(float(lw))
            got.append(float(lg))
        p1, p2 = fz.full_params(plain), fz.full_params(state)
        out[stage, kind, precision, accum] = dict(want=want, got=got, rel=params_rel(p2, p1),
                                                 same=all(torch.equal(p1[k], p2[k]) for k in p1),
                                                 ptrs=[sorted(p) for p in step_ptrs])
    out["seen"] = seen
    return out


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    return run_ranks(2, _watch, str(tmp_path_factory.mktemp("hg")), timeout=300)


def test_no_device_gradient_survives_its_copy(watched):
    for rank in range(2):
        seen = watched[rank]["seen"]
        assert seen["handed"] > 0
        assert seen["alive_after_copy"] == 0, seen  # every device buffer released once copied
        assert seen["device_acc"] == 0 and seen["leaf_grads"] == 0, seen  # nothing accumulated on the device
        assert seen["host_ptrs_shared"] == 0, seen  # the host buffers are storage of their own


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_host_gradients_train_as_the_device_ones(watched, case):
    stage, kind, precision, accum = case
    for rank in range(2):
        r = watched[rank][case]
        if precision == "fp32" or accum == 1:  # the same values in the same order: bit for bit
            assert r["got"] == r["want"] and r["same"], (case, r)
        else:  # the host sums micro-batches in fp32, the device in bf16: within bf16's rounding
            assert r["got"] == pytest.approx(r["want"], rel=2e-2) and r["rel"] < 5e-2, (case, r)


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_host_gradient_buffers_are_reused_step_after_step(watched, case):
    """Host and device are one memory here: each step's host gradients go into the buffers the
    last step used, not into memory mapped (and zeroed by the kernel) afresh."""
    for rank in range(2):
        ptrs = watched[rank][case]["ptrs"]
        assert len(ptrs) == 3 and ptrs[0], ptrs
        assert ptrs[1] == ptrs[0] and ptrs[2] == ptrs[0], (case, ptrs)


def test_the_pool_keeps_plain_buffers_only_for_a_live_owner_and_the_last_steps_sizes():
    import gc

    from fz.offload.transfer import PinnedPool

    class Plan:  # what a step's host gradients are kept for: its state's plan
        pass

    pool, plan, other = PinnedPool(pin=False, max_bytes=None), Plan(), Plan()
    a, b = pool.take(1000, torch.float32), pool.take(10, torch.float32)
    pool.give(a)  # plain memory, no owner: back to the allocator
    assert not pool.free
    pool.give(a, keep_for=plan)
    pool.give(b, keep_for=plan)
    assert pool.take(1000, torch.float32) is a
    pool.give(a, keep_for=plan)
    c = pool.take(20, torch.float32)
    pool.give(c, keep_for=other)  # the pool is the process's: another run's state keeps its own
    pool.keep_only({(1000, torch.float32)}, plan)  # plan's last step used only a's size: b's buffer goes
    assert sorted(pool.free) == [(20, torch.float32), (1000, torch.float32)]
    pool.keep_only({(1000, torch.float32)}, other)  # ... and other's only that size: c goes
    assert list(pool.free) == [(1000, torch.float32)]
    pool.give(c, keep_for=other)
    del other
    gc.collect()  # a run's state gone (whenever the collector finds it) takes only its own buffers
    assert list(pool.free) == [(1000, torch.float32)] and pool.free[1000, torch.float32] == [a]
    del plan
    gc.collect()
    assert not pool.free  # the run's last state is gone: so are the gradients' buffers


def test_tiers_say_gradients_are_on_the_host():
    for policy in (fz.offload.cpu(), fz.offload.cpu(params=True)):
        state = fz.init(make_model(), spec(3, 1, precision="bf16", offload=policy))
        tiers = fz.memory_report(state).tiers
        assert tiers["device"]["grads"] == 0
        n = sum(p.numel() for p in make_model().parameters())
        assert n * 4 <= tiers["host"]["grads"] <= n * 4 * 1.1  # fp32, this one rank's rows (with padding)
    plain = fz.memory_report(fz.init(make_model(), spec(3, 1, precision="bf16"))).tiers
    assert plain["device"]["grads"] > 0 and plain["host"]["grads"] == 0


def _gpt_host_tensors(d: int, layers: int, vocab: int, bucket: int) -> list[tuple[int, torch.dtype]]:
    """The host tensors of a GPT's offloaded state, in fz.init's order: per bucket its bf16
    parameter shard and fp32 master, then Adam's two fp32 moments per parameter."""
    params = [vocab * d, 1024 * d]
    for _ in range(layers):
        params += [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    buckets, cur = [], 0
    for n in params:
        if cur and cur + n > bucket:
            buckets, cur = buckets + [cur], 0
        cur += n
    return ([(n, dt) for b in buckets + [cur] for n, dt in ((b, torch.bfloat16), (b, torch.float32))]
            + [(n, torch.float32) for n in params for _ in range(2)])


def test_slabs_hold_host_state_at_its_exact_size(monkeypatch):
    """torch's pinned allocator rounds each allocation up to a power of two; the state's host
    tensors are carved out of power-of-two slabs instead (pinned on CUDA; plain here, same carving).
    The 2.8B GPT of the GPU benchmark, every size divided by 1024 (slabs too)."""
    from fz.offload import transfer
    monkeypatch.setattr(transfer, "SLAB_BYTES", transfer.SLAB_BYTES // 1024)
    slabs = transfer.Slabs(pin=False)
    shapes = _gpt_host_tensors(d=80, layers=34, vocab=1572, bucket=int(25 * 2**20 / 4 / 1024))
    src = [torch.randn(n).to(dt) for n, dt in shapes] + [torch.randn(7, 9).to(torch.bfloat16).t()]
    out = [slabs.copy(t) for t in src]
    assert all(torch.equal(a, b) and b.is_contiguous() for a, b in zip(src, out))
    exact = sum(t.numel() * t.element_size() for t in src)
    allocator = sum(transfer.rounded(t.numel() * t.element_size()) for t in src)
    assert slabs.slab_bytes <= 1.08 * exact < allocator / 1.25, (slabs.slab_bytes, exact, allocator)
    assert all(t.data_ptr() % transfer.SLAB_ALIGN == 0 for t in out)
    assert transfer.rounded(40 * 2**20 + 1) == 64 * 2**20 and transfer.rounded(4096) == 4096


def test_the_step_s_host_gradients_are_pinned_ahead_at_their_exact_size(monkeypatch):
    """On a GPU fz.init pins the step's fp32 host gradient buffers (pinning 11 GB in the first step
    took seconds of it): carved from slabs at their exact sizes, waiting in the pool, so the step's
    `take` of each size finds one and pins nothing. Plain slabs here (no CUDA), the same carving."""
    from fz.offload import transfer
    from fz.offload.host_grads import HostGrads, host_grad_numels, reserve_host_grads
    monkeypatch.setattr(transfer, "_SLABS", transfer.Slabs(pin=False))
    monkeypatch.setattr(transfer, "SLAB_BYTES", 1 << 16)
    state = fz.init(make_model(), spec(3, 1, precision="bf16", offload=fz.offload.cpu(params=True)))
    sizes = host_grad_numels(state.plan.buckets, state.plan.shards)
    assert len(sizes) == sum(b.trainable for b in state.plan.buckets) and sum(sizes) == sum(
        p.numel() for p in make_model().parameters())
    pool = transfer.PinnedPool(pin=False, max_bytes=None)
    pool.pin = True  # what a CUDA machine's pool is
    reserve_host_grads(pool, state.plan.buckets, state.plan.shards)
    assert pool.pinned_bytes == 4 * sum(sizes)  # exact: no power-of-two rounding
    ready = {t.data_ptr() for bufs in pool.free.values() for t in bufs}
    reserve_host_grads(pool, state.plan.buckets, state.plan.shards)  # a second state: nothing more
    assert pool.pinned_bytes == 4 * sum(sizes)
    host = HostGrads(pool, torch.device("cpu"))
    for i, n in enumerate(sizes):  # the first step's adds take the reserved buffers
        host.add(i, torch.randn(n).to(torch.bfloat16))
    assert {t.data_ptr() for t in host.acc.values()} == ready
    assert pool.pinned_bytes == 4 * sum(sizes)
    bounded = transfer.PinnedPool(pin=False, max_bytes=4 * max(sizes))
    bounded.pin = True
    bounded.reserve([(n, torch.float32) for n in sizes])  # within the pool's bound only
    assert bounded.pinned_bytes <= 4 * max(sizes)
