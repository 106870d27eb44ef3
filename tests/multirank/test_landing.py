"""Stages 1 and 2 with fp32 masters in host memory: each bucket's updated rows land in the
parameters' dtype during the update's own pass, bucket by bucket (fz/offload/landing.py), and
the all-gather takes them from there: no second pass over the masters to cast them. On a GPU
that is the default (with each bucket's copy up beside the next one's update: tests/cuda); on
this CPU it is asked for (`one_memory=True`: by default a CPU-only machine casts after the
update). The results are the bits of the cast after the update (`landing_for` returning None),
on the CPU tier's own tensors and with the optimizer offloaded.
"""
from __future__ import annotations

import functools

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
    launch, default = sync.ParamSync._launch, updaters.landing_for
    landing_for = functools.partial(default, one_memory=True)

    def watched(self, b, flat, mflat):
        rows = mflat if mflat is not None else flat
        inputs.append((rows.dtype, rows.dtype != flat.dtype))
        return launch(self, b, flat, mflat)

    sync.ParamSync._launch = watched
    out: dict = {"by_default": []}
    for offload, stage, accum in CASES:
        policy = fz.offload.cpu() if offload == "cpu" else None
        for landed in (True, False):
            updaters.landing_for = landing_for if landed else (lambda *a: None)
            state = fz.init(make_model(), spec(stage, accum, precision="bf16", offload=policy, bucket_mb=0.02))
            if landed:  # what a CPU-only machine does unasked, and asked
                flats = [f._local_tensor for f in state.param_flats]
                mflats = [m._local_tensor if (m := state.master_flats.get(i)) is not None else None
                          for i in range(len(flats))]
                out["by_default"].append((default(state.plan, flats, mflats, frozenset(), None),
                                          landing_for(state.plan, flats, mflats, frozenset(), None) is not None))
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


def test_a_cpu_only_machine_casts_after_the_update_by_default(runs):
    for rank in range(2):
        assert runs[rank]["by_default"] == [(None, True)] * len(CASES)  # (default, one_memory=True) per case


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_the_gather_takes_rows_already_in_the_parameters_dtype(runs, case):
    for rank in range(2):
        new, old = runs[rank][(*case, True)], runs[rank][(*case, False)]
        assert len(new["inputs"]) == len(old["inputs"]) >= 3 * 4  # 3 steps of several buckets
        assert all(dtype == torch.bfloat16 and not cast for dtype, cast in new["inputs"]), new["inputs"]
        assert all(dtype == torch.float32 and cast for dtype, cast in old["inputs"])  # the masters, cast then
