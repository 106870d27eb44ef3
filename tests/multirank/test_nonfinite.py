"""A NaN or inf never reaches the weights: Spec(nonfinite="skip" | "raise"), every precision and stage.

At step K one rank gets a poisoned batch (a NaN or inf in its inputs) or a poisoned
gradient (an autograd hook in the model). `skip`: every rank's parameters, master weights
and optimizer state are bit-identical to before the step, the skip is counted, and the
run goes on. `raise`: every rank raises fz.NonFiniteError naming the step, and the state
it was given still trains. Then Spec.skip_limit: a run whose every step is skipped (a NaN loss
on rank 1, or fp16 overflows at the minimum loss scale) raises on every rank at the limit,
naming the first non-finite gradient, the count surviving a checkpoint. One world-2 spawn runs
every case.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

import fz
from fz.testing.spawn import run_ranks

K = 1  # the poisoned step
ARMED: list = []  # the value the next backward writes into one gradient element


class _Poison(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ARMED:
            g = g.clone()
            g.view(-1)[0] = ARMED[0]
        return g


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            h = h + torch.tanh(block(h))
            if i == 0:
                h = _Poison.apply(h)
        return self.out(h).squeeze(-1)


def _loss(model, batch):
    return F.mse_loss(model(batch["x"]).float(), batch["y"])


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 8, generator=g)
    return {"x": x, "y": torch.sin(x.sum(1))}


def _snapshot(state):
    state = fz.block_until_ready(state)
    local = lambda t: t._local_tensor.clone() if isinstance(t, DTensor) else t.clone()  # noqa: E731
    leaves = [f for f in state.param_flats] + list(state.master_flats.values())
    leaves += [x for x in pytree.tree_leaves(state.opt_state) if isinstance(x, torch.Tensor)]
    return state, [local(t) for t in leaves]


def _case(rank, precision, stage, kind, policy, value, static_scale=True):
    scaling = fz.LossScale(loss_scale=1024.0) if precision == "fp16" and policy == "raise" and static_scale \
        else fz.LossScale(initial_scale_power=8)
    spec = fz.Spec(stage=stage, precision=precision, nonfinite=policy, loss_fn=_loss, clip_grad_norm=1.0,
                   optimizer=fz.optim.adamw(lr=1e-2), loss_scaling=scaling, bucket_mb=0.001)
    torch.manual_seed(0)
    state = fz.init(Net(), spec)
    out = {}
    for step in range(K + 2):
        batch = _batch(step, rank)
        if step == K:
            state, out["before"] = _snapshot(state)
            if rank == 1 and kind == "batch":
                batch["x"][0, 0] = value
            if rank == 1 and kind == "grad":
                ARMED.append(value)
        try:
            state, loss = fz.train_step(state, batch)
        except fz.NonFiniteError as e:
            out["error"] = str(e)
        ARMED.clear()
        if "error" in out:  # the state it was given still trains
            state, loss = fz.train_step(state, _batch(step, rank))
            out["after_error_loss"] = float(loss)
            return out
        if step == K:
            state, out["after"] = _snapshot(state)
            out["skipped"] = int(state.scaler["skipped"])
            out["scale"] = float(state.scaler.get("scale", 0.0))
    out["last_loss"] = float(loss)
    return out


LIMIT = 3


def _limit_case(rank, precision, ckpt):
    """Steps bad (saved and restored after it), bad, good, bad, bad, bad: the sixth is the LIMIT-th
    skip in a row. fp32: a NaN in rank 1's batch; fp16: an inf gradient with the scale at its floor."""
    spec = fz.Spec(stage=3 if precision == "fp32" else 1, precision=precision, nonfinite="skip", skip_limit=LIMIT,
                   loss_fn=_loss, optimizer=fz.optim.adamw(lr=1e-2), bucket_mb=0.001,
                   loss_scaling=fz.LossScale(initial_scale_power=0, min_loss_scale=1.0))
    torch.manual_seed(0)
    state = fz.init(Net(), spec)
    out: dict = {"in_a_row": []}
    for step in range(6):
        if step == 1:
            fz.save(state, ckpt, verbose=False)
            torch.manual_seed(0)
            state = fz.restore(fz.init(Net(), spec), ckpt, verbose=False)
        batch = _batch(step, rank)
        if step != 2 and precision == "fp32" and rank == 1:
            batch["x"][0, 0] = math.nan
        if step != 2 and precision == "fp16":
            ARMED.append(math.inf)
        try:
            state, _ = fz.train_step(state, batch)
            out["in_a_row"].append(int(state.scaler["skipped_in_a_row"]))
        except fz.NonFiniteError as e:
            out["error"], out["error_step"] = str(e), step
            break
        finally:
            ARMED.clear()
    return out


def _all(rank, world, tmp):
    res = {}
    for precision in ("fp32", "fp16"):
        res["limit", precision] = _limit_case(rank, precision, f"{tmp}/{precision}")
    for i, precision in enumerate(("fp32", "bf16", "fp16")):
        for stage in (0, 1, 2, 3):
            for j, kind in enumerate(("batch", "grad")):
                value = (math.nan, math.inf)[(i + stage + j) % 2]
                for policy in ("skip", "raise"):
                    res[precision, stage, kind, policy] = _case(rank, precision, stage, kind, policy, value)
    res["fp16-dynamic-raise"] = _case(rank, "fp16", 3, "grad", "raise", math.inf, static_scale=False)
    return res


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(2, _all, str(tmp_path_factory.mktemp("ckpt")), timeout=240)


def test_skip_leaves_params_and_optimizer_state_unchanged_on_every_rank(results):
    for rank, res in enumerate(results):
        for key, out in res.items():
            if key[-1] != "skip":
                continue
            assert "error" not in out, (rank, key, out.get("error"))
            assert len(out["before"]) == len(out["after"]) > 0
            for a, b in zip(out["before"], out["after"]):
                assert torch.equal(a, b), (rank, key)
            assert out["skipped"] == 1, (rank, key)
            assert math.isfinite(out["last_loss"]), (rank, key)  # the run goes on


def test_raise_names_the_step_on_every_rank_and_leaves_the_state_usable(results):
    for rank, res in enumerate(results):
        for key, out in res.items():
            if key[-1] != "raise":
                continue
            msg = out.get("error", "")
            assert f"fz.train_step at step {K}:" in msg, (rank, key, msg)
            if key[2] == "grad":
                assert "the first non-finite gradient is '" in msg, (rank, key, msg)
            else:
                assert "the loss is non-finite on rank(s) [1]" in msg, (rank, key, msg)
            assert math.isfinite(out["after_error_loss"]), (rank, key)


def test_fp16_overflow_with_a_dynamic_scale_is_the_scalers_even_under_raise(results):
    for res in results:
        out = res["fp16-dynamic-raise"]
        assert "error" not in out and out["skipped"] == 1
        assert all(torch.equal(a, b) for a, b in zip(out["before"], out["after"]))


def test_a_run_that_skips_every_step_stops_at_skip_limit_on_every_rank(results):
    """The count resets on an update, survives a save and restore, and is the same on every rank."""
    for precision in ("fp32", "fp16"):
        outs = [res["limit", precision] for res in results]
        assert outs[0] == outs[1], precision  # every rank alike, the message included
        out = outs[0]
        assert out["in_a_row"] == [1, 2, 0, 1, 2] and out["error_step"] == 5, (precision, out)
        msg = out["error"]
        assert (f"fz.train_step at step 5: {LIMIT} steps in a row were skipped (steps 3 to 5, "
                f"Spec.skip_limit={LIMIT}), so the weights stopped changing") in msg, msg
        assert "the first non-finite gradient is '" in msg, msg
    assert "the loss is non-finite on rank(s) [1]" in results[0]["limit", "fp32"]["error"]
    assert "The fp16 loss scale is 1 (min_loss_scale 1)." in results[0]["limit", "fp16"]["error"]


def test_nonfinite_policy_is_validated():
    with pytest.raises(fz.ConfigError, match="Spec.nonfinite='ignore'.*'skip', 'raise'"):
        fz.Spec(nonfinite="ignore")
    with pytest.raises(fz.ConfigError, match="timeout_s"):
        fz.Spec(timeout_s=0)
    for bad in (0, -1, True, 2.5, "100"):
        with pytest.raises(fz.ConfigError, match=r"Spec.skip_limit=.*must be an int >= 1 \(steps in a row\) or None"):
            fz.Spec(skip_limit=bad)
    assert fz.Spec().skip_limit == 100 and fz.Spec(skip_limit=None).skip_limit is None
