"""NaN or inf weights at world 2: every rank raises the same fz.NonFiniteError with exact counts,
however the values are split (stage 3: some only in rank 1's rows; stage 1: parameters
replicated, masters sharded; a 2-D mesh of replicas), from fz.init(weights=), fz.load_weights
and fz.restore. One world-2 spawn runs every case."""
from __future__ import annotations

import math
import warnings

import pytest
import torch.nn as nn
from safetensors.torch import save_file

import fz
from fz.testing.spawn import run_ranks

# inp has 16 rows: at world 2, stage 3 puts rows 8..15 on rank 1 only, out.bias's one row on rank 0
SAID = ("holds NaN or inf in 3 tensors (4 values): 'inp.bias' 1 of 16, 'inp.weight' 2 of 128, "
        "'out.bias' 1 of 1")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 1)


def _spec(stage: int, precision: str = "fp32", **kw) -> fz.Spec:
    return fz.Spec(stage=stage, precision=precision, optimizer=fz.optim.adamw(lr=1e-2), **kw)


def _cases(rank: int, world: int, folder: str, tmp: str) -> dict:
    out: dict = {}

    def attempt(key, fn):
        try:
            fn()
            out[key] = None
        except fz.NonFiniteError as e:
            out[key] = str(e)

    attempt("init stage 3", lambda: fz.init(Net(), _spec(3), weights=folder))
    attempt("init stage 1 bf16", lambda: fz.init(Net(), _spec(1, "bf16"), weights=folder))
    attempt("init 2-D mesh", lambda: fz.init(Net(), _spec(3, shard_group_size=1), weights=folder))
    attempt("load_weights stage 2", lambda: fz.load_weights(fz.init(Net(), _spec(2)), folder))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        state = fz.init(Net(), _spec(3, "bf16"), weights=folder, allow_nonfinite=True)
    out["warned"] = [str(w.message) for w in seen if "NaN" in str(w.message)]
    fz.save(state, f"{tmp}/ck", verbose=False)
    attempt("restore stage 3", lambda: fz.restore(fz.init(Net(), _spec(3)), f"{tmp}/ck", verbose=False))
    attempt("restore stage 1 bf16", lambda: fz.restore(fz.init(Net(), _spec(1, "bf16")), f"{tmp}/ck", verbose=False))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("nan")
    sd = {k: v.clone() for k, v in Net().state_dict().items()}
    sd["inp.weight"][[9, 14], 3] = math.nan
    sd["inp.bias"][15] = math.inf
    sd["out.bias"][0] = math.nan
    save_file(sd, folder / "model.safetensors")
    return run_ranks(2, _cases, str(folder), str(tmp_path_factory.mktemp("ck")), timeout=240)


def test_every_rank_raises_the_same_exact_counts(results):
    keys = [k for k in results[0] if k != "warned"]
    assert len(keys) == 6
    for key in keys:
        msgs = [res[key] for res in results]
        assert msgs[0] is not None and msgs[0] == msgs[1], (key, msgs)
        assert SAID in msgs[0], (key, msgs[0])


def test_allow_nonfinite_warns_on_every_rank_with_the_counts(results):
    for res in results:
        assert len(res["warned"]) == 1 and SAID in res["warned"][0], res["warned"]
