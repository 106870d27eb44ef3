"""A 0-d parameter (CLIP's `logit_scale`) in every stage: saved and restored across stages 2 <-> 3
and worlds 1 <-> 2 with equal values, consolidated, and in fz.full_params (issue 27, item 2).

World 1 runs in this process, world 2 in one spawn: each writes its checkpoints and restores
every checkpoint written so far into stages 2 and 3; then world 1 restores world 2's."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

import fz
from fz.ckpt.export import consolidate
from fz.testing.spawn import run_ranks

CASES = ((2, "fp32"), (3, "fp32"), (3, "bf16"))


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.lin(x) * self.logit_scale.exp()


def _loss(model, batch):
    return model(batch).pow(2).mean()


def _spec(stage: int, precision: str) -> fz.Spec:
    return fz.Spec(stage=stage, precision=precision, loss_fn=_loss, optimizer=fz.optim.adamw(lr=1e-2), seed=0)


def _init(stage: int, precision: str):
    torch.manual_seed(0)
    return fz.init(Scaled(), _spec(stage, precision))


def _name(world: int, stage: int, precision: str) -> str:
    return f"w{world}_s{stage}_{precision}"


def _restore_all(rank: int, world: int, root: str) -> dict:
    """{(source checkpoint, stage restored into): full_params} for every checkpoint under root."""
    out = {}
    for src in sorted(p.name for p in Path(root).iterdir() if p.is_dir()):
        for stage in (2, 3):
            state = fz.restore(_init(stage, src.rsplit("_", 1)[1]), f"{root}/{src}", verbose=False)
            out[src, stage] = fz.full_params(state)
    return out


def _job(rank: int, world: int, root: str) -> dict:
    written = {}
    for stage, precision in CASES:
        state = _init(stage, precision)
        for step in range(2):
            data = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(step))
            state, _ = fz.train_step(state, data.chunk(world)[rank])
        fz.save(state, f"{root}/{_name(world, stage, precision)}", verbose=False)
        written[_name(world, stage, precision)] = fz.full_params(state)
    return {"written": written, "restored": _restore_all(rank, world, root)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("scalar"))
    one = _job(0, 1, root)
    two = run_ranks(2, _job, root, timeout=300)
    back = _restore_all(0, 1, root)  # world 1 reads world 2's too
    return root, {**one["written"], **two[0]["written"]}, [one["restored"], back, *(r["restored"] for r in two)]


def test_full_params_holds_the_scalar(runs):
    _, written, _ = runs
    for name, params in written.items():
        assert params["logit_scale"].shape == (), name
        assert float(params["logit_scale"]) != 2.0, name  # trained


def test_restored_across_stages_and_worlds(runs):
    _, written, restored = runs
    seen = set()
    for got in restored:
        for (src, stage), params in got.items():
            assert set(params) == set(written[src]), (src, stage)
            for k, v in written[src].items():
                assert torch.equal(params[k], v), (src, stage, k)
            seen.add((src[:2], src[3:5], stage))
    assert {(w, s, t) for w in ("w1", "w2") for s in ("s2", "s3") for t in (2, 3)} <= seen


def test_consolidated_holds_the_scalar(runs, tmp_path):
    root, written, _ = runs
    for name in written:
        out = tmp_path / f"{name}.safetensors"
        consolidate(f"{root}/{name}", out, progress=False)
        tensors = load_file(str(out))
        assert tensors["logit_scale"].shape == ()
        want = written[name]["logit_scale"]  # the fp32 master, in the file as in full_params
        assert torch.equal(tensors["logit_scale"].to(want.dtype), want), name
        model = Scaled()
        model.load_state_dict(tensors, strict=True)
