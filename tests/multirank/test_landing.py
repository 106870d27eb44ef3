"""Stages 1 and 2 with fp32 masters in host memory: each bucket's updated rows land in the
parameters' dtype during the update's own pass, bucket by bucket (fz/offload/landing.py), and
the all-gather takes them from there: no second pass over the masters to cast them. The
results are the bits of the cast after the update (`landing_for` returning None: the path
before), on the CPU tier's own tensors and with the optimizer offloaded.
"""
from __future__ import annotations

import pytest
import torch

import fz
from fz.testing.spawn import run_ranks

from support.helpers import make_model, rank_batches, spec

CASES = [("none", 1, 1), ("cpu", 2, 1), ("cpu", 2, 2), ("cpu", 1, 1)]  # (offload, stage, grad_accum)


def _run(rank: int, world: int) -> dict:
    import fz.step.updaters as updaters
    from fz.sharding import sync

    inputs: list[tuple[torch.dtype, bool]] = []  # (dtype, cast now) of each gathered bucket's rows
    launch, landing_for = sync.ParamSync._launch, updaters.landing_for

    def watched(self, b, flat, mflat):
        rows = mflat if mflat is not None else flat
        inputs.append((rows.dtype, rows.dtype != flat.dtype))
        return launch(self, b, flat, mflat)

    sync.ParamSync._launch = watched
    out = {}
    for offload, stage, accum in CASES:
        policy = fz.offload.cpu() if offload == "cpu" else None
        for landed in (True, False):
            updaters.landing_for = landing_for if landed else (lambda *a: None)
            state = fz.init(make_model(), spec(stage, accum, precision="bf16", offload=policy, bucket_mb=0.02))
            del inputs[:]
            losses = []
            for b in rank_batches(world, accum, 3):
                state, loss = fz.train_step(state, b[rank])
                losses.append(float(loss))
            out[offload, stage, accum, landed] = dict(losses=losses, params=fz.full_params(state, dtype="compute"),
                                                      master=fz.full_params(state),
                                                      inputs=list(inputs))
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(2, _run, timeout=300)


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_landed_rows_give_the_bits_of_the_cast_after_the_update(runs, case):
    for rank in range(2):
        new, old = runs[rank][(*case, True)], runs[rank][(*case, False)]
        assert new["losses"] == old["losses"]
        for what in ("params", "master"):
            assert new[what].keys() == old[what].keys()
            assert all(torch.equal(new[what][k], old[what][k]) for k in new[what]), what


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_the_gather_takes_rows_already_in_the_parameters_dtype(runs, case):
    for rank in range(2):
        new, old = runs[rank][(*case, True)], runs[rank][(*case, False)]
        assert len(new["inputs"]) == len(old["inputs"]) >= 3 * 4  # 3 steps of several buckets
        assert all(dtype == torch.bfloat16 and not cast for dtype, cast in new["inputs"]), new["inputs"]
        assert all(dtype == torch.float32 and cast for dtype, cast in old["inputs"])  # the masters, cast then
