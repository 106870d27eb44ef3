"""Offload as state transformers: the same trajectory bit for bit, leaves where the policy says,
bounded memory, and every bad input a clear error before training (or a failed step naming the file).

One world-2 spawn runs every stage x tier x precision against the same run without offload;
the bad-input cases run in-process at world 1.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fz
from fz.storage.disk import load
from fz.testing.spawn import run_ranks

from support.helpers import make_model, rank_batches, spec

STEPS = 3
CASES = [(stage, kind, precision) for stage in (1, 2, 3) for kind in ("cpu", "nvme") for precision in ("fp32", "bf16")]
CASES += [(3, "nvme-params", "fp32"), (3, "nvme-params", "bf16"), (3, "cpu-params", "fp32"), (3, "cpu-params", "bf16")]


def _policy(kind: str, path: str):
    if kind == "cpu":
        return fz.offload.cpu()
    if kind == "cpu-params":
        return fz.offload.cpu(params=True)
    # a small buffer: buckets stream in several groups
    return fz.offload.nvme(path, params=kind == "nvme-params", buffer_mb=0.05, buffers=3, prefetch=2)


def _full(state):
    """Full parameters, and this rank's fp32 master rows in mixed precision."""
    out = {k: v.clone() for k, v in fz.full_params(state).items()}
    for k, v in (state.master or {}).items():
        out["master/" + k] = load(v._local_tensor).clone()
    return out


def _run(state, rank, batches, steps):
    losses = []
    for b in batches[:steps]:
        state, loss = fz.train_step(state, b[rank])
        losses.append(float(loss))
    return state, losses


def _tiers(state):
    return {t: {k: v for k, v in kinds.items() if v} for t, kinds in fz.memory_report(state).tiers.items()}


def _bin_files(path):
    return [f for _, _, fs in os.walk(path) for f in fs if f.endswith(".bin")]


def _parity(rank, world, root):
    out = {}
    batches = rank_batches(world, 1, 2 * STEPS)
    for stage, kind, precision in CASES:
        path = os.path.join(root, f"r{rank}")
        os.makedirs(path, exist_ok=True)
        plain, want = _run(fz.init(make_model(), spec(stage, 1, precision=precision)), rank, batches, STEPS)
        state = fz.init(make_model(), spec(stage, 1, precision=precision, offload=_policy(kind, path)))
        tiers0 = _tiers(state)
        state, got = _run(state, rank, batches, STEPS)
        out[stage, kind, precision] = dict(want=want, got=got, same=all(
            torch.equal(a, b) for a, b in zip(_full(plain).values(), _full(state).values())), tiers=tiers0,
            tiers_after=_tiers(state), report=fz.memory_report(state).total == fz.memory_report(plain).total)
    # mid-training: plain 2 steps, offload to disk for 2, back for 2 == plain 6 steps; donate=False twice
    path = os.path.join(root, f"mid{rank}")
    os.makedirs(path)
    sp = spec(3, 1, precision="bf16")
    ref, want = _run(fz.init(make_model(), sp), rank, batches, 2 * STEPS)
    s = fz.init(make_model(), sp)
    got = []
    for i, b in enumerate(batches[:2 * STEPS]):
        if i == 2:
            s = fz.offload.nvme(path, params=True, buffer_mb=0.05, buffers=2, prefetch=1)(s)
            files_while = len(_bin_files(path))
            a, la = fz.train_step(s, b[rank], donate=False)
            bb, lb = fz.train_step(s, b[rank], donate=False)
            twice = float(la) == float(lb) and all(
                torch.equal(x, y) for x, y in zip(_full(a).values(), _full(bb).values())
            )
            del a, bb
        if i == 4:
            s = fz.offload.none()(s)
        s, loss = fz.train_step(s, b[rank])
        got.append(float(loss))
    same = all(torch.equal(x, y) for x, y in zip(_full(ref).values(), _full(s).values()))
    del s
    gc.collect()
    out["mid"] = dict(want=want, got=got, same=same, twice=twice, files_while=files_while, files_after=_bin_files(path))
    return out


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    return run_ranks(2, _parity, str(tmp_path_factory.mktemp("offload")), timeout=300)


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_offload_is_bit_identical(parity, case):
    for rank in range(2):
        r = parity[rank][case]
        assert r["got"] == r["want"], (case, r)
        assert r["same"], case
        assert r["report"], case  # the ZeRO accounting does not change with the tier


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_leaves_live_in_their_tier(parity, case):
    stage, kind, precision = case
    for when in ("tiers", "tiers_after"):
        t = parity[0][case][when]
        where = "host" if kind.startswith("cpu") else "disk"
        assert t[where].get("moments", 0) > 0 and "moments" not in t["device"], t
        if precision != "fp32":
            assert t[where].get("master", 0) > 0 and "master" not in t["device"], t
        if kind.endswith("params"):
            assert t[where].get("params", 0) > 0, t
        else:
            assert "params" not in t["disk"] and "params" not in t["host"], t


def test_offload_applied_mid_training_and_removed(parity):
    for rank in range(2):
        r = parity[rank]["mid"]
        assert r["got"] == r["want"] and r["same"] and r["twice"], r
        assert r["files_while"] > 0
        assert r["files_after"] == [], r["files_after"]  # dropped state -> files removed


# ----------------------------------------------------------------------------- bad input (world 1)

def _small_state(path, **kw):
    return fz.init(make_model(), spec(2, 1, precision="bf16", offload=fz.offload.nvme(str(path), **kw)))


def test_missing_file_and_readonly_directories(tmp_path, monkeypatch):
    _small_state(tmp_path / "new" / "dir")  # made, as DeepSpeed makes its nvme_path
    assert (tmp_path / "new" / "dir").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(fz.ConfigError, match="does not exist and cannot be made"):
        _small_state(tmp_path / "file" / "under")
    with pytest.raises(fz.ConfigError, match="not a directory"):
        _small_state(tmp_path / "file")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):  # root: the kernel ignores the mode, so the answer is simulated
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(ro) else real(p, mode))
    try:
        with pytest.raises(fz.ConfigError, match="not writable"):
            _small_state(ro)
    finally:
        ro.chmod(0o700)


def test_too_small_directory(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(fz.ConfigError, match=r"GiB free; this rank's offloaded state needs"):
        _small_state(tmp_path)
    assert not any(f.endswith(".bin") for _, _, fs in os.walk(tmp_path) for f in fs)


def test_params_offload_needs_stage_3_and_nvme_needs_a_path(tmp_path):
    with pytest.raises(fz.ConfigError, match="needs ZeRO stage 3"):
        spec(2, 1, offload=fz.offload.cpu(params=True))
    with pytest.raises(fz.ConfigError, match="needs ZeRO stage 1, 2 or 3"):
        spec(0, 1, offload=fz.offload.cpu())
    with pytest.raises(fz.ConfigError, match="needs a path"):
        fz.offload.Offload(optimizer="disk")


def test_global_norm_inside_the_chain_is_refused_on_disk(tmp_path):
    opt = fz.optim.chain(fz.optim.clip_by_global_norm(1.0), fz.optim.adamw(lr=1e-3))
    state = fz.init(make_model(), spec(2, 1, optimizer=opt, offload=fz.offload.nvme(str(tmp_path))))
    with pytest.raises(fz.ConfigError, match="clip_grad_norm"):
        fz.train_step(state, rank_batches(1, 1, 1)[0][0])


def test_io_error_mid_step_names_the_file_and_the_input_stays_whole(tmp_path, monkeypatch):
    from fz.storage import io as offload_io
    batch = rank_batches(1, 1, 1)[0][0]
    _, want = fz.train_step(_small_state(tmp_path, buffer_mb=0.05, buffers=2, prefetch=1), batch)
    state = _small_state(tmp_path, buffer_mb=0.05, buffers=2, prefetch=1)
    real, calls = offload_io.IOPool._io, []

    def failing(self, blob, offset, buf, write):
        calls.append(write)
        if write and calls.count(True) == 2:
            raise OSError(5, f"offload write of {blob.path} at byte {offset}: Input/output error")
        return real(self, blob, offset, buf, write)

    monkeypatch.setattr(offload_io.IOPool, "_io", failing)
    with pytest.raises(OSError, match=r"offload write of .*opt-rank0-b\d+-\d+\.bin"):
        fz.train_step(state, batch, donate=False)
    monkeypatch.setattr(offload_io.IOPool, "_io", real)
    _, loss = fz.train_step(state, batch, donate=False)  # the input state is whole: the step runs again
    assert float(loss) == float(want)
    calls.clear()
    monkeypatch.setattr(offload_io.IOPool, "_io", failing)
    with pytest.raises(OSError) as e:
        fz.train_step(state, batch)  # donated: consumed, and the error says what to do
    assert any("restore the last checkpoint" in n for n in getattr(e.value, "__notes__", []))
    with pytest.raises(fz.ConfigError, match="donated"):
        fz.train_step(state, batch)


def _allocated(path):
    """{file: (inode, allocated bytes)} of the .bin files under `path`."""
    out = {}
    for d, _, fs in os.walk(path):
        for f in fs:
            if f.endswith(".bin"):
                st = os.stat(os.path.join(d, f))
                out[f] = (st.st_ino, st.st_blocks * 512)
    return out


def test_a_donated_step_updates_the_disk_tier_in_place(tmp_path, monkeypatch):
    """The files a donated step reads are the ones it writes: no file is added, and the disk use
    during the step never exceeds the tier's by more than one group (its padding written). With
    donate=False the update needs new files: refused before anything is written when they do not fit."""
    from fz.step import stream
    from fz.storage import io as offload_io
    buffer_mb = 0.05
    sp = spec(3, 1, precision="bf16",
              offload=fz.offload.nvme(str(tmp_path), params=True, buffer_mb=buffer_mb, buffers=2, prefetch=1))
    batches = rank_batches(1, 1, 2)
    _, want = _run(fz.init(make_model(), sp.replace(offload=None)), 0, batches, 2)
    state = fz.init(make_model(), sp)
    before = _allocated(tmp_path)
    used, real = [], offload_io.IOPool._io

    def measured(self, blob, offset, buf, write):
        real(self, blob, offset, buf, write)
        used.append(sum(n for _, n in _allocated(tmp_path).values()))

    monkeypatch.setattr(offload_io.IOPool, "_io", measured)
    state, loss = fz.train_step(state, batches[0][0])
    after = _allocated(tmp_path)
    assert after.keys() == before.keys() and all(after[f][0] == before[f][0] for f in after)  # same files
    tier = sum(n for _, n in before.values())
    assert used and max(used) <= tier + int(buffer_mb * 2**20) + 4096, (max(used) - tier, tier)

    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(stream.shutil, "disk_usage", lambda p: usage(2 * tier, tier, tier // 2))
    with pytest.raises(fz.ConfigError, match=r"donate=False.*need \d+\.\d+ GiB on .*; 0\.\d+ GiB are free"):
        fz.train_step(state, batches[1][0], donate=False)
    assert _allocated(tmp_path).keys() == before.keys()  # nothing written
    monkeypatch.undo()
    state, loss2 = fz.train_step(state, batches[1][0])  # the refused step left the state whole
    assert [float(loss), float(loss2)] == want


def test_stale_directory_is_detected_and_never_reused(tmp_path):
    stale = tmp_path / "fz-offload-host-999999-0"
    stale.mkdir()
    import socket
    (stale / "owner").write_text(json.dumps({"host": socket.gethostname(), "pid": 2**22 + 12345}))
    (stale / "opt-rank0-b0-0.bin").write_bytes(b"\0" * 4096)
    from fz.storage import store
    store._STORES.pop((str(tmp_path), os.getpid()), None)
    with pytest.warns(UserWarning, match="left by a run that is gone"):
        state = _small_state(tmp_path)
    assert not stale.exists()
    files = [p for p in tmp_path.rglob("*.bin")]
    assert files and all(str(os.getpid()) in str(p.parent.name) for p in files)
    del state


def test_checkpoints_move_between_tiers(tmp_path):
    """Saved with NVMe offload, restored without it (and the other way round): the runs go on
    exactly as the run that never offloaded."""
    batches = [b[0] for b in rank_batches(1, 1, 4)]
    sp = spec(3, 1, precision="bf16")
    nv = sp.replace(offload=fz.offload.nvme(str(tmp_path), params=True, buffer_mb=0.05, buffers=2, prefetch=1))
    plain, off = fz.init(make_model(), sp), fz.init(make_model(), nv)
    for b in batches[:2]:
        plain, _ = fz.train_step(plain, b)
        off, _ = fz.train_step(off, b)
    fz.save(off, tmp_path / "from_nvme")
    fz.save(plain, tmp_path / "from_plain")
    fz.wait_for_checkpoints()
    a = fz.restore(fz.init(make_model(), sp), tmp_path / "from_nvme")
    b_ = fz.restore(fz.init(make_model(), nv), tmp_path / "from_plain")
    assert fz.memory_report(b_).tiers["disk"]["moments"] > 0 and not fz.memory_report(a).tiers["disk"]["moments"]
    want, got_a, got_b = [], [], []
    for b in batches[2:]:
        plain, l0 = fz.train_step(plain, b)
        a, l1 = fz.train_step(a, b)
        b_, l2 = fz.train_step(b_, b)
        want.append(float(l0)), got_a.append(float(l1)), got_b.append(float(l2))
    assert got_a == want and got_b == want
    for x, y, z in zip(_full(plain).values(), _full(a).values(), _full(b_).values()):
        assert torch.equal(x, y) and torch.equal(x, z)


def test_stage3_shards_on_disk_are_read_ahead(tmp_path, monkeypatch):
    """A block further than the prefetch reads its shards from disk in the background; the
    gather uses what was read, and the run stays bit-identical."""
    from fz.sharding import gather
    from fz.testing.gpt import GPTConfig
    cfg = GPTConfig(vocab=64, seq=16, dim=32, heads=2, layers=4)
    used = []
    real = gather.Gatherer._source
    monkeypatch.setattr(gather.Gatherer, "_source",
                        lambda self, b, shard: (used.append(b.index in self.reads), real(self, b, shard))[1])
    batches = [b[0] for b in rank_batches(1, 1, 2)]
    sp = spec(3, 1, precision="bf16")
    plain = fz.init(make_model(cfg=cfg), sp)
    off = fz.init(make_model(cfg=cfg), sp.replace(offload=fz.offload.nvme(str(tmp_path), params=True, buffer_mb=0.05)))
    for b in batches:
        plain, l0 = fz.train_step(plain, b)
        off, l1 = fz.train_step(off, b)
        assert float(l0) == float(l1)
    assert any(used) and not all(used), used  # some gathers found their shard read ahead
    for x, y in zip(_full(plain).values(), _full(off).values()):
        assert torch.equal(x, y)


# ----------------------------------------------------------------------------- memory (subprocess)

_RSS = textwrap.dedent("""
    import json, os, sys, torch, fz
    from fz.testing.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens
    torch.set_num_threads(1)
    kind, path = sys.argv[1], sys.argv[2]
    cfg = GPTConfig(vocab=256, seq=16, dim=512, heads=4, layers=18)
    with torch.device("meta"):
        model = GPT(cfg)
    policy = fz.offload.nvme(path, buffer_mb=8, buffers=2, prefetch=1) if kind == "nvme" else None
    spec = fz.Spec(stage=1, optimizer=fz.optim.adamw(lr=1e-3), loss_fn=lm_loss, bucket_mb=4, offload=policy)
    state = fz.init(model, spec)
    data = synthetic_tokens(2, cfg.seq, cfg.vocab, seed=0)
    for _ in range(2):
        state, loss = fz.train_step(state, data)
    r = fz.memory_report(state)
    hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
    print(json.dumps({"hwm": hwm, "disk": sum(r.tiers["disk"].values()), "opt": r.opt,
                      "io": r.tiers["host"].get("io_buffers", 0), "loss": float(loss)}))
""")


@pytest.mark.slow  # the slow tier (.ci/run: -m slow)
def test_nvme_offload_lowers_peak_rss_by_most_of_the_offloaded_bytes(tmp_path):
    def run(kind):
        out = subprocess.run([sys.executable, "-c", _RSS, kind, str(tmp_path)], capture_output=True, text=True,
                             timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])
    plain, nvme = run("plain"), run("nvme")
    assert nvme["opt"] >= 200e6 and nvme["disk"] == nvme["opt"], nvme
    assert nvme["io"] == 2 * 8 * 2**20
    saved = plain["hwm"] - nvme["hwm"]
    assert saved >= 0.8 * nvme["disk"], (saved / 2**20, nvme["disk"] / 2**20, plain, nvme)
    assert nvme["loss"] == plain["loss"]
