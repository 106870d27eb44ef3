"""Checkpoints across processes: exact continuation for every stage, resharding to other
world sizes and stages, async saves, damaged checkpoints seen by every rank, and
fz.Checkpointer (two with saves in flight at once, failed async saves).

One spawn writes the checkpoints (world 2, 6 steps, then 6 more); fresh spawns restore
them (world 2 and 4) and this process restores at world 1. Tests assert on the results.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

import fz
from fz.ckpt import restore, save, wait_for_checkpoints
from fz.ckpt.export import consolidate
from fz.ckpt.hf.safetensors_io import load_weights
from fz.ckpt.tree import opt_leaves
from fz.errors import ConfigError
from fz.testing.spawn import run_ranks

from support.ckpt_hooks import Hold, arm
from support.helpers import make_model, max_rel, rank_batches, reference, spec

WORLD, SAVE_AT, MORE = 2, 6, 6
STAGES = (0, 1, 2, 3)
TOL = 1e-5
CLIENT = {"note": "hi", "t": torch.arange(3), "pair": (1, 2.5), "nested": {"xs": [1, None, True]}}


def _batches(world: int):
    """batches[step][rank]: the world-2 global batches split over `world` ranks (same data at any world)."""
    return [list(torch.cat(per_rank).chunk(world)) for per_rank in rank_batches(WORLD, 1, SAVE_AT + MORE)]


def _moments(state) -> dict:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in opt_leaves(state.opt_state).items()
    }


def _snapshot(state) -> dict:
    return {"params": fz.full_params(state), "opt": _moments(state), "rng": state.rng.clone(), "step": int(state.step)}


def _continue(state, rank: int, world: int):
    losses = []
    for per_rank in _batches(world)[SAVE_AT:]:
        state, loss = fz.train_step(state, per_rank[rank])
        losses.append(float(loss))
    return state, losses


def _write(rank: int, world: int, root: str) -> dict:
    out = {}
    for stage in STAGES:
        state = fz.init(make_model(), spec(stage, 1))
        for per_rank in _batches(world)[:SAVE_AT]:
            state, _ = fz.train_step(state, per_rank[rank])
        state = state.replace(data={"epoch": 1, "seen": [SAVE_AT, rank], "gen": torch.full((2,), rank)})
        save(state, f"{root}/s{stage}", client_state=CLIENT)
        out[stage] = _snapshot(state)
        if stage == 3:  # async: the write is held until save() has returned and training overwrote the buffers
            hold = Hold()
            disarm = arm("write_begin", hold)
            save(state, f"{root}/async", async_=True)
            early = (Path(root) / "async" / f"step_{SAVE_AT}").exists()
        state, out[stage]["losses"] = _continue(state, rank, world)
        if stage == 3:
            hold.release()
            wait_for_checkpoints()
            disarm()
            out["async"] = (hold.held_out, early, (Path(root) / "async" / f"step_{SAVE_AT}").exists())
    state = fz.init(make_model(), spec(3, 1, precision="bf16"))  # mixed precision: master weights saved
    for per_rank in _batches(world)[:SAVE_AT]:
        state, _ = fz.train_step(state, per_rank[rank])
    save(state, f"{root}/bf16")
    out["bf16"] = {"master": {n: m.full_tensor().clone() for n, m in state.master.items()}}
    _, out["bf16"]["losses"] = _continue(state, rank, world)
    out["objects"] = _objects(rank, world, root)
    return out


def _fresh():
    return fz.init(make_model(1), spec(2, 1))


def _disk_full(*args):
    raise OSError("disk full")


def _error(fn) -> str:
    try:
        fn()
    except (ConfigError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def _objects(rank: int, world: int, root: str) -> dict:
    """fz.Checkpointer: round trip, two with async saves in flight at once, failed async saves,
    its steps, and the with block waiting for the last save."""
    state = fz.init(make_model(), spec(2, 1))
    batches = _batches(world)
    for per_rank in batches[:SAVE_AT]:
        state, _ = fz.train_step(state, per_rank[rank])
    state = state.replace(data={"rank": rank})
    out = {"want": _snapshot(state)}
    ck = fz.Checkpointer(f"{root}/obj", keep_last=2)
    out["empty"] = (ck.latest_step(), ck.all_steps())
    for n in (2, 4, SAVE_AT):
        ck.save(state, step=n, client_state={"n": n})
    got, client = ck.restore(_fresh(), with_client_state=True)
    out["obj"] = dict(_snapshot(got), data=got.data, client=client, steps=(ck.latest_step(), ck.all_steps()))

    hold = Hold()  # both writes are held until both saves returned and training went on
    disarm = arm("write_begin", hold)
    a, b = fz.Checkpointer(f"{root}/a", async_=True), fz.Checkpointer(f"{root}/b", async_=True)
    a.save(state)
    b.save(state)
    early = (a.latest_step(), b.latest_step())
    state, _ = fz.train_step(state, batches[SAVE_AT][rank])
    hold.release()
    a.wait()
    fz.wait_for_checkpoints()  # waits for b, a Checkpointer's save
    disarm()
    out["two"] = (hold.held_out, early, a.latest_step(), b.latest_step(),
                  [_snapshot(c.restore(_fresh())) for c in (a, b)])

    f = fz.Checkpointer(f"{root}/fail", async_=True)
    f.save(state, step=1)
    f.save(state, step=2, client_state={"sparse": torch.eye(2).to_sparse()})  # DCP fails, in its thread
    dcp_err = _error(f.wait)
    real = fz.ckpt.manifest.describe
    if rank == 1:  # fz's checksum phase fails on rank 1 only, in the commit thread
        fz.ckpt.manifest.describe = _disk_full
    f.save(state, step=3)
    fz_err = _error(f.wait)
    fz.ckpt.manifest.describe = real
    torch.distributed.barrier()  # rank 0 has removed the debris
    out["fail"] = (dcp_err, fz_err, f.latest_step(), sorted(os.listdir(f"{root}/fail")), _error(f.wait))
    f.close()

    hold = Hold()  # the write is held until the step is looked at inside the block
    disarm = arm("write_begin", hold)
    with fz.Checkpointer(f"{root}/ctx", async_=True) as c:
        c.save(state)
        inside = c.latest_step()
        hold.release()
    disarm()
    out["with"] = (inside, c.latest_step(), _error(lambda: c.save(state)))
    return out


def _resharded(path: str, stage: int, rank: int, world: int) -> dict:
    state = restore(fz.init(make_model(1), spec(stage, 1)), path)
    snap = _snapshot(state)
    _, snap["losses"] = _continue(state, rank, world)
    return snap


def _read_world2(rank: int, world: int, root: str) -> dict:
    out = {}
    for stage in STAGES:
        state, client = restore(fz.init(make_model(1), spec(stage, 1)), f"{root}/s{stage}", with_client_state=True)
        out[stage] = dict(_snapshot(state), data=state.data, client=client)
        _, out[stage]["losses"] = _continue(state, rank, world)
    out["s3->1"] = _resharded(f"{root}/s3", 1, rank, world)
    # an fp32 checkpoint into a mixed-precision template: Shard(0) master, Replicate bf16 params
    mixed = restore(fz.init(make_model(1), spec(1, 1, precision="bf16")), f"{root}/s3")
    out["master"] = ({n: m.full_tensor() for n, m in mixed.master.items()}, fz.full_params(mixed, dtype="compute"))
    out["async"] = _snapshot(restore(fz.init(make_model(1), spec(3, 1)), f"{root}/async"))
    out["errors"] = {}
    for name in sorted(os.listdir(f"{root}/bad")):
        t = time.perf_counter()
        try:
            restore(fz.init(make_model(1), spec(3, 1)), f"{root}/bad/{name}")
            out["errors"][name] = (None, 0.0)
        except ConfigError as e:
            out["errors"][name] = (str(e), time.perf_counter() - t)
    out["weights"] = fz.full_params(load_weights(fz.init(make_model(1), spec(3, 1)), f"{root}/s3.safetensors"))
    mixed = restore(fz.init(make_model(1), spec(1, 1, precision="bf16")), f"{root}/bf16")
    out["bf16"] = {"master": {n: m.full_tensor() for n, m in mixed.master.items()}}
    _, out["bf16"]["losses"] = _continue(mixed, rank, world)
    out["bf16->fp32"] = fz.full_params(restore(fz.init(make_model(1), spec(0, 1)), f"{root}/bf16"))
    return out


def _read_world4(rank: int, world: int, root: str) -> dict:
    return _resharded(f"{root}/s3", 2, rank, world)


def _damage(root: Path) -> None:
    """Copies of the stage-3 checkpoint, each damaged in one way."""
    src = root / "s3" / f"step_{SAVE_AT}"
    bad = root / "bad"
    for name in ("truncated", "flipped", "deleted"):
        shutil.copytree(src, bad / name)
    shard = bad / "truncated" / "__1_0.distcp"
    os.truncate(shard, shard.stat().st_size - 100)
    with open(bad / "flipped" / "__0_0.distcp", "r+b") as f:
        f.seek(2000)
        b = f.read(1)
        f.seek(2000)
        f.write(bytes([b[0] ^ 0x40]))
    (bad / "deleted" / "__1_0.distcp").unlink()


@pytest.fixture(scope="module")
def results(tmp_path_factory, load):
    root = tmp_path_factory.mktemp("ckpt")
    wrote = run_ranks(WORLD, _write, str(root), timeout=300)
    _damage(root)
    consolidate(root / "s3", root / "s3.safetensors")
    with load:
        read2 = run_ranks(WORLD, _read_world2, str(root), timeout=300)
    read4 = run_ranks(4, _read_world4, str(root), timeout=300)
    read1 = [_resharded(str(root / "s3"), 0, 0, 1)]
    return {"wrote": wrote, "read2": read2, "read4": read4, "read1": read1}


def _assert_same(got: dict, want: dict, what) -> None:
    assert got["step"] == want["step"] == SAVE_AT, what
    assert set(got["params"]) == set(want["params"]) and set(got["opt"]) == set(want["opt"]), what
    for k in want["params"]:
        assert torch.equal(got["params"][k], want["params"][k]), (what, k)
    for k in want["opt"]:
        assert torch.equal(got["opt"][k], want["opt"][k]), (what, k)


def test_restore_in_a_new_process_continues_bit_identically(results):
    for stage in STAGES:
        for rank in range(WORLD):
            want, got = results["wrote"][rank][stage], results["read2"][rank][stage]
            _assert_same(got, want, (stage, rank))
            assert torch.equal(got["rng"], want["rng"]), (stage, rank)
            assert got["losses"] == want["losses"], (stage, rank, got["losses"], want["losses"])
            assert got["data"]["seen"] == [SAVE_AT, rank] and torch.equal(got["data"]["gen"], torch.full((2,), rank))
            c = got["client"]
            assert c["note"] == "hi" and c["pair"] == (1, 2.5) and c["nested"] == CLIENT["nested"]
            assert torch.equal(c["t"], CLIENT["t"])


def test_restore_reshards_to_other_world_sizes_and_stages(results):
    want = results["wrote"][0][3]
    ref_losses, _ = reference(WORLD, 1, SAVE_AT + MORE)
    cases = {"world1 stage0": results["read1"], "world4 stage2": results["read4"],
             "world2 stage1": [r["s3->1"] for r in results["read2"]]}
    for what, per_rank in cases.items():
        for rank, got in enumerate(per_rank):
            _assert_same(got, want, (what, rank))
            assert max_rel(got["losses"], ref_losses[SAVE_AT:]) < TOL, (what, rank, got["losses"])
    # RNG: ranks that existed keep theirs; new ranks get distinct derived ones
    rngs = [r["rng"] for r in results["read4"]]
    for rank in range(WORLD):
        assert torch.equal(rngs[rank], results["wrote"][rank][3]["rng"])
    assert not torch.equal(rngs[2], rngs[3]) and not torch.equal(rngs[2], rngs[0])


def test_restore_into_a_state_with_master_weights(results):
    want = results["wrote"][0][3]["params"]
    for rank in range(WORLD):
        master, params = results["read2"][rank]["master"]
        assert set(params) == set(want) and set(master) < set(want)  # full_params also names the tied head
        for k in master:
            assert torch.equal(master[k], want[k]) and torch.equal(params[k], want[k].to(torch.bfloat16)), k


def test_mixed_precision_checkpoint_restores_across_stage_and_precision(results):
    for rank in range(WORLD):
        saved, read = results["wrote"][rank]["bf16"], results["read2"][rank]["bf16"]
        for k, m in saved["master"].items():
            assert m.dtype == torch.float32 and torch.equal(read["master"][k], m), k
            assert torch.equal(results["read2"][rank]["bf16->fp32"][k], m), k  # fp32 params = master
        assert read["losses"] == saved["losses"]  # bf16 at stage 1 continues the stage-3 run exactly


def test_async_save_returns_before_the_write_and_matches_a_sync_save(results):
    for rank in range(WORLD):
        held_out, early, done = results["wrote"][rank]["async"]
        assert not held_out and not early and done, results["wrote"][rank]["async"]  # save() did not wait
        got, want = results["read2"][rank]["async"], results["wrote"][rank][3]
        _assert_same(got, want, ("async", rank))
        assert torch.equal(got["rng"], want["rng"])


def test_damaged_checkpoint_fails_on_every_rank_naming_the_file(results, load):
    expect = {"truncated": ("__1_0.distcp", "truncated"), "flipped": ("__0_0.distcp", "corrupted"),
              "deleted": ("__1_0.distcp", "missing")}
    for rank in range(WORLD):
        for name, (fname, word) in expect.items():
            msg, seconds = results["read2"][rank]["errors"][name]
            assert msg is not None and fname in msg and word in msg, (rank, name, msg)
            assert seconds < load.scaled(30), (name, seconds, load)


def test_load_weights_of_consolidated_file_reshards(results):
    want = results["wrote"][0][3]["params"]
    for rank in range(WORLD):
        got = results["read2"][rank]["weights"]
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k


def test_checkpointer_saves_restores_and_lists_steps(results):
    for rank in range(WORLD):
        obj = results["wrote"][rank]["objects"]
        assert obj["empty"] == (None, [])
        got, want = obj["obj"], obj["want"]
        _assert_same(got, want, ("Checkpointer", rank))
        assert torch.equal(got["rng"], want["rng"])
        assert got["data"] == {"rank": rank} and got["client"] == {"n": SAVE_AT}
        assert got["steps"] == (SAVE_AT, [4, SAVE_AT])  # keep_last=2


def test_two_checkpointers_with_async_saves_in_flight_both_commit(results):
    for rank in range(WORLD):
        obj = results["wrote"][rank]["objects"]
        held_out, early, a, b, restored = obj["two"]
        assert not held_out and early == (None, None) and a == b == SAVE_AT, obj["two"][:4]  # neither waited
        for got in restored:  # what was staged, not the step trained after save() returned
            _assert_same(got, obj["want"], ("two", rank))


def test_wait_raises_a_failed_async_save_and_the_checkpointer_goes_on(results):
    for rank in range(WORLD):
        dcp_err, fz_err, latest, names, again = results["wrote"][rank]["objects"]["fail"]
        assert dcp_err.startswith("CheckpointError: writing checkpoint") and "step_2.tmp" in dcp_err, dcp_err
        assert "NotImplementedError" in dcp_err, dcp_err
        if rank == 1:
            assert fz_err == "OSError: disk full", fz_err
        else:  # the other rank learns which rank failed and why
            assert "failed on rank 1: OSError: disk full" in fz_err and "step_3.tmp" in fz_err, fz_err
        assert latest == 1 and names == ["latest", "step_1"] and again == "", (latest, names, again)


def test_with_block_waits_for_the_last_save(results):
    for rank in range(WORLD):
        inside, after, closed = results["wrote"][rank]["objects"]["with"]
        assert inside is None and after == SAVE_AT + 1, (inside, after)
        assert "is closed" in closed, closed
