"""Ranks of one host share memory for their collectives (fz/distributed/shm.py): the same bits as
the pairwise exchange and as a sum in rank order, chunk by chunk; ranks in different collectives
and a rank that exits fail at once, named, instead of exchanging the wrong bytes or hanging."""
from __future__ import annotations

import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from support.ranks import cached_runs

SLOT = 64 << 10  # the smallest slot: the tensors below take many chunks


def _inputs(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank)).to(dtype)


def _failed(work) -> tuple[str, float]:
    t = time.monotonic()
    try:
        work.wait(timedelta(seconds=60))
    except RuntimeError as e:
        return str(e), time.monotonic() - t
    return "", time.monotonic() - t


def _checks(rank: int, world: int) -> dict:
    import os

    import torch.distributed as dist

    from fz.distributed import shm
    from fz.sharding.comm import Comm

    ranks = tuple(range(world))
    link = shm.open_link(dist.group.WORLD, ranks, rank, 1)
    assert link is not None and link.slot == SLOT
    assert shm.open_link(dist.group.WORLD, ranks, rank, 1) is link  # one link per group
    dist.barrier()
    assert link.where.startswith("/dev/shm/fz-link-") and not os.path.exists(link.where)  # nothing left behind
    try:  # a wrong argument fails at the call, on this rank, and leaves the link whole
        link.all_gather(torch.empty(3), torch.empty(2))
    except ValueError as e:
        assert "a contiguous output of 8 elements and an input of 2" in str(e), e  # 4 ranks x 2
    else:
        raise AssertionError("a wrong size was not refused")
    pid = os.fork()  # a forked child (a DataLoader's worker) lets go of the FIFOs
    if pid == 0:
        os._exit(0 if link.closed and not link.reads and not link.writes and shm.link_of(dist.group.WORLD) is None
                 else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert not link.closed and len(link.writes) == world - 1
    plan = SimpleNamespace(shard_group=dist.group.WORLD, shards=world, shard_rank=rank, replica_group=None,
                           replicas=1, shard_ranks=ranks, device=torch.device("cpu"))
    os.environ["FZ_COLLECTIVES"] = "pairwise"
    pairwise = Comm(plan)
    out: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = 50_001  # per rank: not a multiple of any chunk
        x = _inputs(rank, world * m, dtype)
        gathered = torch.empty(world * m, dtype=dtype)
        link.all_gather(gathered, x[:m]).wait()
        out["all_gather", dtype] = gathered
        strided = torch.empty(world * m, dtype=dtype)
        link.all_gather(strided, x[:2 * m:2]).wait()  # an input of any layout
        out["all_gather strided", dtype] = strided
        mine = torch.empty(m, dtype=dtype)
        link.reduce_scatter(mine, x, average=True).wait()
        theirs = torch.empty(m, dtype=dtype)
        pairwise.reduce_scatter(theirs, x)
        out["reduce_scatter", dtype] = (mine, theirs)
        total = x.clone()
        link.all_reduce(total, average=False).wait()
        out["all_reduce", dtype] = total
    sub = dist.new_group([0, 1])
    if rank < 2:  # two ranks in different collectives
        pair = shm.open_link(sub, (0, 1), rank, 1)
        assert pair is not None and pair is not link
        t = torch.ones(1000)
        out["mismatch"] = _failed(pair.all_gather(torch.empty(2000), t) if rank == 0
                                  else pair.all_reduce(t, average=False))
    other = dist.new_group([2, 3])
    if rank >= 2:  # a rank that does not see rank 2's /dev/shm (another host): no link, for both
        real = shm._sees
        shm._sees = (lambda where, token: False) if rank == 3 else real
        out["apart"] = shm.open_link(other, (2, 3), rank - 2, 1)
        shm._sees = real
    dist.barrier()
    if rank < world - 1:  # the last rank returns (its process exits): the others are told at once
        out["lost"] = _failed(link.all_reduce(torch.ones(10), average=False))
    return out


@pytest.fixture(scope="module")
def results(load):
    with load:
        return cached_runs(4, _checks, timeout=180)


def test_shared_memory_collectives_are_exact(results):
    world, m = 4, 50_001
    for dtype in (torch.float32, torch.bfloat16):
        xs = [_inputs(r, world * m, dtype) for r in range(world)]
        want = xs[0] + xs[1]  # the pairwise exchange's order: rank order, then the mean
        for x in xs[2:]:
            want += x
        for rank, res in enumerate(results):
            assert torch.equal(res["all_gather", dtype], torch.cat([x[:m] for x in xs]))
            assert torch.equal(res["all_gather strided", dtype], torch.cat([x[:2 * m:2] for x in xs]))
            mine, theirs = res["reduce_scatter", dtype]
            assert torch.equal(mine, theirs)
            assert torch.equal(mine, want.view(world, m)[rank] / world)
            assert torch.equal(res["all_reduce", dtype], want)


def test_ranks_in_different_collectives_fail_naming_both(results, load):
    for rank in (0, 1):
        said, took = results[rank]["mismatch"]
        assert "the ranks are in different collectives" in said, said
        assert "all_gather of 1000 elements of torch.float32" in said and "all_reduce of 1000 elements" in said
        assert took < load.scaled(10), (took, load)


def test_ranks_that_do_not_share_dev_shm_keep_gloo(results):
    assert results[2]["apart"] is None and results[3]["apart"] is None


def test_a_rank_that_exits_is_named_at_once(results, load):
    for res in results[:3]:
        said, took = res["lost"]
        assert said == "Connection closed: rank 3 of the shared-memory link exited or failed"
        assert took < load.scaled(10), (took, load)
