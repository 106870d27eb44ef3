"""Hybrid sharding on a 2-D mesh ("replicate", "shard"): world 4 as 2 groups of 2.

ZeRO shards within each group, the groups replicate each other: the trajectory equals the
single-process reference (and 1-D stage 3 at world 4), per-rank model-state bytes follow
the ZeRO formula with N = group size, only one all-reduce of gradient shards crosses groups,
and checkpoints move between mesh shapes (2x2 <-> 4 <-> 1, and 2 -> 2x2).
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import fz
from fz.ckpt.tree import opt_leaves
from fz.testing.spawn import run_ranks

from support.helpers import make_model, max_rel, params_rel, rank_batches, reference, spec, train_fz

STEPS, GA, GROUP = 4, 2, 2
TOL = 1e-5


def _moments(state):
    return {k: v.full_tensor().clone() for k, v in opt_leaves(state.opt_state).items() if hasattr(v, "full_tensor")}


def _snapshot(state):
    return fz.full_params(state), _moments(state), int(state.step)


def _write_world2(rank, world, root):
    state, _ = train_fz(rank, world, 3, 1, steps=2)
    fz.save(state, f"{root}/w2")
    return _snapshot(state)


def _world4(rank, world, root):
    out = {}
    for stage in (0, 1, 2, 3):
        state, losses = train_fz(rank, world, stage, GA, steps=STEPS, shard_group_size=GROUP)
        out["train", stage] = (losses, fz.full_params(state), fz.memory_report(state).as_dict(),
                               tuple(map(str, state.params["wte.weight"].placements)))
        one = fz.init(make_model(), spec(stage, 1, shard_group_size=GROUP))
        one, _ = fz.train_step(one, rank_batches(world, 1, 1)[0][rank])
        rep = fz.comm_report(one)
        out["comm", stage] = (rep.payload, rep.inter_payload, rep.world, rep.replicas)
    state, losses = train_fz(rank, world, 3, GA, steps=STEPS)  # 1-D stage 3 over all four ranks
    out["flat3"] = (losses, fz.full_params(state))
    one = fz.init(make_model(), spec(3, 1))
    one, _ = fz.train_step(one, rank_batches(world, 1, 1)[0][rank])
    out["flat3_comm"] = fz.comm_report(one).payload
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    state = fz.init(make_model(), spec(3, GA), mesh=mesh)
    losses = []
    for per_rank in rank_batches(world, GA, STEPS):
        state, loss = fz.train_step(state, per_rank[rank])
        losses.append(float(loss))
    out["explicit_mesh"] = losses
    # checkpoints across mesh shapes
    restored = fz.restore(fz.init(make_model(1), spec(3, 1, shard_group_size=GROUP)), f"{root}/w2")
    out["w2_on_2x2"] = _snapshot(restored)
    state, _ = train_fz(rank, world, 3, 1, steps=2, shard_group_size=GROUP)
    fz.save(state, f"{root}/m22")
    out["m22"] = _snapshot(state)
    out["m22_on_4"] = _snapshot(fz.restore(fz.init(make_model(1), spec(3, 1)), f"{root}/m22"))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mesh2d"))
    w2 = run_ranks(2, _write_world2, root)
    w4 = run_ranks(4, _world4, root)
    w1 = _snapshot(fz.restore(fz.init(make_model(1), spec(3, 1)), f"{root}/m22"))
    return w2, w4, w1


def test_2x2_mesh_follows_the_reference_and_1d_stage3(runs):
    _, w4, _ = runs
    want_losses, want_params = reference(4, GA, STEPS)
    for res in w4:
        for stage in (0, 1, 2, 3):
            losses, params, _, placements = res["train", stage]
            assert max_rel(losses, want_losses) < TOL, stage
            assert params_rel(params, want_params) < TOL, stage
            sharded = "S(0)" if stage == 3 else "R"
            assert placements == ("R", sharded)  # one placement per mesh dimension
        flat_losses, flat_params = res["flat3"]
        assert max_rel(res["train", 3][0], flat_losses) < TOL and params_rel(res["train", 3][1], flat_params) < TOL
        assert res["explicit_mesh"] == res["train", 3][0]  # fz.init(mesh=2-D mesh) is the same thing
    for k, v in w4[0]["train", 3][1].items():  # every rank ends with the same weights
        assert all(torch.equal(v, r["train", 3][1][k]) for r in w4), k


def test_2x2_memory_is_the_zero_formula_with_n_the_group_size(runs):
    _, w4, _ = runs
    psi = sum(p.numel() for p in make_model().parameters())
    want = {0: (4, 4, 8), 1: (4, 4, 8 / GROUP), 2: (4, 4 / GROUP, 8 / GROUP), 3: (4 / GROUP, 4 / GROUP, 8 / GROUP)}
    for res in w4:
        for stage, (p, g, o) in want.items():
            m = res["train", stage][2]
            assert m["world"] == GROUP
            assert (m["params"], m["grads"], m["opt"]) == (p * psi, g * psi, o * psi), (stage, m)
            assert (m["formula_params"], m["formula_grads"], m["formula_opt"]) == (p * psi, g * psi, o * psi)


def test_2x2_comm_report_separates_intra_and_inter_group_bytes(runs):
    _, w4, _ = runs
    psi = sum(p.numel() for p in make_model().parameters())
    root = sum(p.numel() for n, p in make_model().named_parameters() if not n.startswith("blocks."))
    intra = {  # the 1-D formulas with N = the group size (payload bytes, fp32)
        0: {"all_reduce": 4 * psi},
        1: {"reduce_scatter": 4 * psi, "all_gather": 4 * psi},
        2: {"reduce_scatter": 4 * psi, "all_gather": 4 * psi},
        3: {"reduce_scatter": 4 * psi, "all_gather": 4 * (2 * psi - root)},
    }
    for res in w4:
        for stage in (0, 1, 2, 3):
            payload, inter, n, replicas = res["comm", stage]
            assert (n, replicas) == (GROUP, 2)
            assert {k: v for k, v in payload.items() if k != "scalar"} == intra[stage], stage
            # across groups: one all-reduce of the gradient shards (stage 0: the whole gradient)
            assert inter["all_reduce"] == (4 * psi if stage == 0 else 4 * psi // GROUP), (stage, inter)
            # the loss, with each rank's step, rows, call-order checksum and two non-finite slots
            assert inter.get("scalar", 0) == 8 * (1 + 5 * 4)
        # what crosses groups is 1/group of what 1-D stage 3 reduce-scatters over all four ranks
        assert res["comm", 3][1]["all_reduce"] * GROUP == res["flat3_comm"]["reduce_scatter"]


def test_checkpoints_move_between_mesh_shapes(runs):
    w2, w4, w1 = runs
    for res in w4:
        for (params, moments, step), (want_p, want_m, want_step) in (
                (res["w2_on_2x2"], w2[0]), (res["m22_on_4"], res["m22"])):
            assert step == want_step
            assert params.keys() == want_p.keys() and all(torch.equal(params[k], want_p[k]) for k in want_p)
            assert moments.keys() == want_m.keys() and all(torch.equal(moments[k], want_m[k]) for k in want_m)
    params, moments, step = w1
    want_p, want_m, want_step = w4[0]["m22"]
    assert step == want_step and all(torch.equal(params[k], want_p[k]) for k in want_p)
    assert all(torch.equal(moments[k], want_m[k]) for k in want_m)


def test_shard_group_size_must_divide_the_world():
    with pytest.raises(fz.ConfigError, match="shard_group_size"):
        fz.Spec(shard_group_size=0)
    assert fz.Spec.from_deepspeed({"train_micro_batch_size_per_gpu": 1,
                                   "zero_optimization": {"stage": 3, "mics_shard_size": 2}},
                                  world_size=4).shard_group_size == 2
