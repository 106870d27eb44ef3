"""Host <-> device copies at their minimum, counted (fz.comm_report's `h2d` / `d2h`).

With parameters and optimizer state offloaded to the host (stage 3), each parameter shard
crosses up once for the forward and once for backward (only where backward needs the weight:
an embedding's does not), and each reduced gradient crosses down once, in the dtype it was
reduced in; nothing else moves. At stage 2 with the optimizer offloaded no parameter crosses
up for the forward; the host update's parameters go back (or, in fp32 without masters, down
and back). The figures are exact byte counts against those formulas, per rank, at world 1
and 2, in fp32 and bf16, with and without activation checkpointing. On this CPU host and
device are one memory: the counts are of the copies fz issues as a GPU would make them.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fz

from support.helpers import make_model, rank_batches, spec
from support.ranks import cached_runs

EMBEDDINGS = ("wte", "wpe")  # units whose backward needs no weight: never gathered again
SIZE = {"fp32": 4, "bf16": 2}
STAGE3 = [(p, ac, red) for p in ("fp32", "bf16") for ac in (False, True) for red in (None, "bf16")
          if not (p == "fp32" and red)]


def _untied():
    """The test GPT with its head untied: every bucket is used by one unit (a tied weight is
    gathered once a forward for all its users: `test_a_tied_weight_crosses_up_once_per_forward`)."""
    model = make_model()
    model.head.weight = nn.Parameter(model.wte.weight.detach().clone())
    return model


def _buckets(state, rank):
    """Per trainable bucket: what the formulas need (its unit's name, this rank's shard and rows)."""
    out = []
    for b, flat in zip(state.plan.buckets, state.param_flats):
        if b.trainable:
            out.append(dict(unit=state.skeleton.units[b.unit].name, local=flat._local_tensor.numel(),
                            shard=b.shard_numel, full=b.full_numel,
                            rows=sum(torch.Size(s.local_shape(rank)).numel() for s in b.slots)))
    return out


def _steps(state, rank, world, steps=2, accum=1):
    reports = []
    for per_rank in rank_batches(world, accum, steps):
        state, _ = fz.train_step(state, per_rank[rank])
        rep = fz.comm_report(state)
        reports.append((rep.h2d, rep.d2h))
    if rank == 0:  # local: one rank alone reads it (a collective here would hang the run)
        str(fz.comm_report(state))
    return state, reports


def _checks(rank, world):
    out = {}
    for precision, ac, reduce in STAGE3:
        s = spec(3, 1, precision=precision, activation_checkpointing=ac, reduce_dtype=reduce,
                 offload=fz.offload.cpu(params=True))
        state, reports = _steps(fz.init(_untied(), s), rank, world)
        out["stage3", precision, ac, reduce] = (reports, _buckets(state, rank))
        out["unprefetched", precision, ac, reduce] = int(state.metrics["unprefetched"])
    s = spec(3, 2, precision="bf16", offload=fz.offload.cpu(params=True))
    state, reports = _steps(fz.init(_untied(), s), rank, world, steps=1, accum=2)
    out["accum2"] = (reports, _buckets(state, rank))
    s = spec(3, 1, precision="bf16", offload=fz.offload.cpu(params=True))
    state, reports = _steps(fz.init(make_model(), s), rank, world, steps=1)
    out["tied"] = (reports, _buckets(state, rank))
    for precision in ("fp32", "bf16"):
        s = spec(2, 1, precision=precision, offload=fz.offload.cpu())
        state, reports = _steps(fz.init(make_model(), s), rank, world)
        out["stage2", precision] = (reports, _buckets(state, rank))
    s = spec(3, 1, precision="bf16")  # nothing offloaded: nothing counted
    out["none"] = _steps(fz.init(make_model(), s), rank, world, steps=1)[1]
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def runs(request):
    return request.param, cached_runs(request.param, _checks, timeout=400)


def _grad_size(precision, reduce, world):
    """Bytes an element of a reduced gradient has: the parameters' dtype with one rank (no
    reduction), the reduce dtype (fp32 unless set) with several."""
    return SIZE[precision] if world == 1 else SIZE[reduce or "fp32"]


@pytest.mark.parametrize("case", STAGE3, ids=lambda c: f"{c[0]}-ac{int(c[1])}-reduce{c[2] or 'fp32'}")
def test_stage3_offloaded_params_cross_once_each_way(runs, case):
    world, results = runs
    precision, _, reduce = case
    for rank, res in enumerate(results):
        reports, buckets = res[("stage3", *case)]
        size = SIZE[precision]
        assert all(b["local"] == (b["full"] if world == 1 else b["shard"]) for b in buckets)
        forward = sum(b["local"] for b in buckets) * size
        recompute = sum(b["local"] for b in buckets if b["unit"] not in EMBEDDINGS) * size
        grads = sum(b["shard"] for b in buckets) * _grad_size(precision, reduce, world)
        for h2d, d2h in reports:  # every step alike: the counts are the step's, not a running sum
            assert h2d == {"forward": forward, "recompute": recompute}, (rank, h2d)
            assert d2h == {"grads": grads}, (rank, d2h)


@pytest.mark.parametrize("case", STAGE3, ids=lambda c: f"{c[0]}-ac{int(c[1])}-reduce{c[2] or 'fp32'}")
def test_every_upload_but_the_first_is_prefetched(runs, case):
    """Once a step has learned the call order, each offloaded shard's transfer is in flight
    before its unit runs (at one rank the upload alone, on the copy stream), for the forward
    and for backward, recomputed blocks (activation checkpointing) too. This GPT's root holds
    no parameter of its own (its leaves are units): the first unit's starts as the root runs."""
    _, results = runs
    for res in results:
        assert res[("unprefetched", *case)] == 0


def test_micro_batches_each_move_their_own(runs):
    world, results = runs
    for res in results:
        (h2d, d2h), = res["accum2"][0]
        buckets = res["accum2"][1]
        assert h2d["forward"] == 2 * sum(b["local"] for b in buckets) * 2
        assert d2h == {"grads": 2 * sum(b["shard"] for b in buckets) * _grad_size("bf16", None, world)}


def test_a_tied_weight_crosses_up_once_per_forward(runs):
    """The embedding's weight is the head's too: gathered for the embedding, held for the head
    (no second transfer), and once more for the head's backward."""
    world, results = runs
    for res in results:
        (h2d, _), = res["tied"][0]
        buckets = res["tied"][1]
        assert any(b["unit"] == "wte" for b in buckets)  # (the head's weight too)
        assert h2d["forward"] == sum(b["local"] for b in buckets) * 2
        assert h2d["recompute"] == sum(b["local"] for b in buckets if b["unit"] != "wpe") * 2  # for the head


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage2_moves_no_parameter_up_for_the_forward(runs, precision):
    world, results = runs
    for res in results:
        reports, buckets = res["stage2", precision]
        # one rank: the whole gradient, unreduced, in the parameters' dtype; several: this rank's
        # reduce-scattered rows in fp32
        grads = sum(b["full"] * SIZE[precision] if world == 1 else b["shard"] * 4 for b in buckets)
        rows = sum(b["full"] if world == 1 else b["rows"] for b in buckets)
        masters = sum(b["full"] if world == 1 else b["shard"] for b in buckets)
        for h2d, d2h in reports:
            if precision == "bf16":  # the updated masters cast into the parameters on the device
                assert h2d == {"other": masters * 2}
                assert d2h == {"grads": grads}
            else:  # no masters: the parameters' rows go down to the update and back
                assert h2d == {"other": rows * 4}
                assert d2h == {"grads": grads, "other": rows * 4}


def test_nothing_offloaded_nothing_counted(runs):
    _, results = runs
    for res in results:
        assert res["none"] == [({}, {})]


def test_narrow_gradients_widen_on_the_host_to_the_same_bits():
    """Later micro-batches add a bf16 gradient into the fp32 host buffer a chunk at a time
    through a widened scratch (3x torch's mixed-dtype add here): the same sums, bit for bit."""
    from collections import Counter

    from fz.offload.host_grads import WIDEN_CHUNK, HostGrads
    from fz.offload.transfer import PinnedPool

    n = 2 * WIDEN_CHUNK + 3
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(n, generator=g).to(torch.bfloat16) for _ in range(3)]
    moved: Counter = Counter()
    host = HostGrads(PinnedPool(pin=False, max_bytes=None), torch.device("cpu"), moved=moved)
    for p in parts:
        host.add(0, p)
    want = parts[0].float()
    for p in parts[1:]:
        want.add_(p)  # torch's own fp32 += bf16
    assert torch.equal(host.acc[0], want)
    assert moved == {"grads": 3 * n * 2}  # each crossed once, in bf16
