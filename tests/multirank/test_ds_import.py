"""fz.import_deepspeed (issue 25): checkpoints DeepSpeed 0.19.8 wrote (tests/data/deepspeed/: ZeRO 0-3,
fp32 and bf16, world 2, a tied embedding and a frozen layer; some with two parameter groups, as the Trainer
gives DeepSpeed) restored into fz at world 1, 2 and 4 and
every ZeRO stage.

The weights equal DeepSpeed's own zero_to_fp32 output (and the live engine's fp32 masters) exactly;
the Adam moments equal the engine's exactly; the step and client state come across; the next two
steps' losses equal DeepSpeed's next two (the second follows an update that used the imported
moments, Adam step and lr schedule): within fp32 noise in fp32, within bf16's in bf16 (DeepSpeed
runs its bf16 model in bf16, fz under autocast).
"""
from __future__ import annotations

import json

import pytest

from fz.testing.spawn import run_ranks

from support import ds_models as m
from support.ds_import_jobs import DATA, import_job

WORLDS = (1, 2, 4)


def _stages(world: int) -> dict[str, list[int]]:
    """Every fixture into every stage at worlds 1 and 2; at world 4 (slow on CI's two cores) each
    fixture into one stage, every stage twice. The fixtures trained with two parameter groups go
    into stages 0 and 3 at worlds 1 and 2, and one stage each at world 4."""
    grouped = sorted(m.GROUPED)
    if world < 4:
        return {name: [0, 1, 2, 3] for name in m.FIXTURES} | {name: [0, 3] for name in grouped}
    return {name: [i % 4] for i, name in enumerate(sorted(m.FIXTURES))} | {n: [i] for i, n in enumerate(grouped)}


@pytest.fixture(scope="module")
def imported():
    """World 1 in this process (fz starts its own one-rank group), worlds 2 and 4 spawned."""
    return {world: import_job(0, 1, _stages(1)) if world == 1 else run_ranks(world, import_job, _stages(world),
                                                                            timeout=300)[0] for world in WORLDS}


def _cases(imported):
    for world, results in imported.items():
        for (name, stage), r in results.items():
            yield world, name, stage, r, json.loads((DATA / name / "record.json").read_text())


def test_every_fixture_is_restored_at_every_world_size_and_stage(imported):
    assert {(w, n, s) for w, n, s, _, _ in _cases(imported)} == {
        (w, n, s) for w in WORLDS for n, stages in _stages(w).items() for s in stages}
    for w in WORLDS:
        assert {s for stages in _stages(w).values() for s in stages} == {0, 1, 2, 3}


def test_weights_equal_zero_to_fp32s_exactly(imported):
    for world, name, stage, r, record in _cases(imported):
        where = f"{name} -> fz stage {stage} at world {world}"
        if record["zero_to_fp32"] == "ok":  # zero_to_fp32 does not read stage 0
            assert r["z2f_keys"] and r["z2f_equal"], where
            assert {"embed.weight", "head.weight", "frozen.weight"} <= set(r["z2f_keys"]) or record["stage"] == 1
        assert r["masters_equal"], where


def test_adam_moments_step_and_client_state_come_across(imported):
    for world, name, stage, r, record in _cases(imported):
        assert r["moments_equal"], f"{name} -> fz stage {stage} at world {world}"
        assert r["step"] == record["steps"]
        # the client's keys, and DeepSpeed's own fields of the file as its load_checkpoint returns them
        assert {k: r["client_state"][k] for k in record["client_state"]} == record["client_state"]
        assert r["client_state"]["ds_config"] == record["config"] and r["client_state"]["global_samples"] == 12


def test_next_steps_losses_equal_deepspeeds(imported):
    for world, name, stage, r, record in _cases(imported):
        want = [sum(rank[i] for rank in record["next_losses"]) / len(record["next_losses"]) for i in range(2)]
        tol = 1e-6 if record["precision"] == "fp32" else 2e-3
        assert r["losses"] == pytest.approx(want, rel=tol), f"{name} -> fz stage {stage} at world {world}"


def _last_nu_negative(kind: str, rank: int, obj: dict) -> None:
    if kind == "optim" and rank == 1:  # DeepSpeed's rank 1 holds w's elements 12-23 first: w's last one
        obj["optimizer_state_dict"]["optimizer_state_dict"]["state"][0]["exp_avg_sq"][11] = -1.0


def test_a_negative_exp_avg_sq_one_rank_reads_is_refused_on_every_rank(tmp_path):
    """Only fz's rank 1 reads w's last row; the counts are summed, so both ranks refuse it alike (none hangs)."""
    from support import ds_hostile as h

    root = h.checkpoint(tmp_path / "ck", patch=_last_nu_negative)
    got = run_ranks(2, h.refusal, root, timeout=120)
    assert got[0] == got[1] and got[0].startswith("CheckpointError: fz.import_deepspeed: DeepSpeed checkpoint"), got
    assert "negative values in Adam's exp_avg_sq (a mean of squares: never < 0) of 1 tensors: 'w' exp_avg_sq 1 of 24" \
        in got[0], got
