"""Issue 27's faults: a frozen store host, a rank dying right before a collective API, a step
that raised mid-collective, a rank stuck writing its part of a checkpoint; issue 40's: a rank
that crashed before fz.save, a rank frozen or killed while fz.init starts the group. Every
survivor raises an fz.PeerError saying what happened, within its bound; nothing hangs or aborts.

Each test runs two ranks of tests/support/fault_jobs.py (rank 0 hosts the job's store).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fz.distributed import peers
from fz.distributed.storecall import STORE_S
from fz.testing.spawn import free_port

from support.timing import MARGIN_S, Slowdown, slowdown

pytestmark = pytest.mark.slow  # the slow tier: .ci/run runs it (-m slow)

JOB = Path(__file__).parents[1] / "support" / "fault_jobs.py"


def run_job(mode: str, timeout_s: float, tmp_path: Path, stop_rank0: bool = False, env_extra: dict | None = None,
            limit_s: float = 120.0, ranks: tuple[int, ...] = (0, 1)) -> dict[int, tuple[int | None, str]]:
    """{rank: (exit status, output)} of a two-rank job of `mode`, for `ranks` (the others are killed);
    `limit_s` is a quiet machine's: a rank still running after it, scaled to this machine now, hangs."""
    limit_s *= slowdown()
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(root), str(root / "tests"), os.environ.get("PYTHONPATH", "")]),
               **(env_extra or {}))
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    args = [sys.executable, str(JOB), mode, str(timeout_s), str(tmp_path)]
    procs = [subprocess.Popen(args, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    out: dict[int, tuple[int | None, str]] = {}
    try:
        if stop_rank0:
            for p in procs:
                line = p.stdout.readline()
                assert line.strip() == "ready", line + p.stdout.read()
            procs[0].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        for r in ([1] if stop_rank0 else ranks):
            try:
                text, _ = procs[r].communicate(timeout=max(1.0, limit_s - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                procs[r].send_signal(signal.SIGUSR1)  # its stacks, then kill it
                time.sleep(1)
                procs[r].kill()
                text = "(it hangs)\n" + procs[r].communicate()[0]
            out[r] = (procs[r].returncode, text)
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()


def peer_error(text: str) -> tuple[str, float, str]:
    """(ranks, seconds since the fault, message) of a PEERERROR line."""
    line = next((ln for ln in text.splitlines() if ln.startswith("PEERERROR")), None)
    assert line is not None, text[-3000:]
    _, rest = line.split(" ", 1)
    ranks, rest = rest.split("] ", 1)
    took, msg = rest.split(" ", 1)
    return ranks + "]", float(took), msg


def test_a_frozen_store_host_is_a_peer_error_naming_rank_0(tmp_path):
    timeout_s = 3.0
    t0 = time.monotonic()
    with Slowdown() as slow:
        out = run_job("frozen", timeout_s, tmp_path, stop_rank0=True, limit_s=timeout_s + 60)
    status, text = out[1]
    assert status == 3, (status, text[-3000:])
    ranks, _, msg = peer_error(text)
    assert ranks == "[0]", msg
    assert "the job's store, hosted by rank 0, does not answer" in msg and "lost rank(s) [0]" in msg, msg
    bound = timeout_s + peers.PROBE + STORE_S + slow.margin(MARGIN_S + 15)
    assert time.monotonic() - t0 < bound, (slow, text[-2000:])


def test_a_rank_killed_right_before_save_is_named_within_seconds(tmp_path):
    with Slowdown() as slow:
        out = run_job("kill_save", 60.0, tmp_path, limit_s=60)  # well under Spec.timeout_s: the heartbeat tells
    status, text = out[0]
    assert status == 3, (status, text[-3000:])
    ranks, took, msg = peer_error(text)
    assert ranks == "[1]", msg
    assert "fz.save waited for rank(s) [1] to call it too: lost rank(s) [1]: no heartbeat" in msg, msg
    assert took < peers.PROBE + slow.margin(), (slow, msg)
    assert text.count("Warning") + text.count("[W") < 3, text[-3000:]  # no flood of c10d warnings


def test_rank_0_killed_right_before_full_params_is_a_peer_error(tmp_path):
    with Slowdown() as slow:
        out = run_job("kill_full_params", 60.0, tmp_path, limit_s=60)
    status, text = out[1]
    assert status == 3, (status, text[-3000:])  # not a raw DistNetworkError
    ranks, took, msg = peer_error(text)
    assert ranks == "[0]", msg
    assert "hosted by rank 0, does not answer" in msg, msg
    assert took < STORE_S + slow.margin(), (slow, msg)


def test_a_step_that_raised_mid_collective_refuses_the_next_call_without_aborting(tmp_path):
    timeout_s = 3.0
    with Slowdown() as slow:
        out = run_job("raise_fwd", timeout_s, tmp_path, limit_s=90)
    status, text = out[0]
    assert status == 0, (status, text[-3000:])  # no SIGABRT (gloo: collective mismatch)
    refused = next((ln for ln in text.splitlines() if ln.startswith("REFUSED")), "")
    assert "fz.train_step: this process's state is unusable after a failed step" in refused, text[-3000:]
    assert "restart it from the last checkpoint" in refused, refused
    status, text = out[1]
    assert status == 3, (status, text[-3000:])
    _, took, msg = peer_error(text)
    assert "rank(s) [0]: fz.train_step at step 2 failed in the middle of its collectives" in msg, msg
    assert took < timeout_s + peers.PROBE + slow.margin(), (slow, msg)


def test_a_rank_stuck_writing_its_checkpoint_part_is_named_with_the_limit(tmp_path):
    with Slowdown() as slow:
        out = run_job("stuck_write", 60.0, tmp_path, env_extra={"FZ_CKPT_TIMEOUT": "3"}, limit_s=60,
                      ranks=(0,))  # rank 1 sleeps in its write: killed
    status, text = out[0]
    assert status == 3, (status, text[-3000:])
    _, took, msg = peer_error(text)
    said = "rank(s) [1] did not finish writing or reading their part of the checkpoint within the limit (3 s"
    assert said in msg, msg
    assert "the limit that fired: 3 s" in msg, msg
    assert took < 3 + peers.PROBE + slow.margin(), (slow, msg)


def test_a_rank_killed_in_an_async_save_is_a_peer_error_naming_it(tmp_path):
    timeout_s = 3.0
    with Slowdown() as slow:
        out = run_job("kill_async", timeout_s, tmp_path, limit_s=60, ranks=(0,))
    status, text = out[0]
    assert status == 3, (status, text[-3000:])  # not gloo's raw "Connection reset by peer"
    ranks, took, msg = peer_error(text)
    assert ranks == "[1]", msg
    assert "lost rank(s) [1]" in msg, msg
    assert took < timeout_s + peers.PROBE + slow.margin(), (slow, msg)


CRASHES = [("crash_save", "fz.save at step 2: fz.save waited for the other ranks to call it too: rank(s) [1] crashed "
                          "(rank 1: RuntimeError: injected: the data loader failed)"),
           ("crash_step", "fz.train_step at step 2: a collective failed: rank(s) [1] crashed (rank 1: RuntimeError: "
                          "injected: the data loader failed)")]


@pytest.mark.parametrize("mode,said", CRASHES, ids=[m for m, _ in CRASHES])
def test_a_rank_that_crashed_is_named_with_its_error_not_as_a_skipped_call(mode, said, tmp_path):
    with Slowdown() as slow:
        out = run_job(mode, 60.0, tmp_path, limit_s=60)
    status, text = out[0]
    assert status == 3, (status, text[-3000:])
    ranks, took, msg = peer_error(text)
    assert ranks == "[1]", msg
    assert said in msg, msg
    assert "if rank == 0" not in msg and "every rank must call" not in msg, msg  # it did not skip the call
    assert took < peers.PROBE + slow.margin(), (slow, msg)  # not Spec.timeout_s=60
    assert out[1][0] == 1 and "RuntimeError: injected: the data loader failed" in out[1][1], out[1]


# (mode, victim, Spec.timeout_s, what the survivor's error says, the bound it must meet but for MARGIN_S)
STARTS = [("stop_join", 1, 5.0, "fz.init: rank(s) [1] did not join the job within 5 s (Spec.timeout_s", 5.0),
          ("stop_start", 0, 30.0, "fz.init: starting the process group: the job's store, hosted by rank 0, does not "
                                  "answer", STORE_S + peers.PROBE),
          ("kill_start", 1, 30.0, "fz.init: starting the process group: lost rank(s) [1]: no heartbeat", peers.PROBE)]


@pytest.mark.parametrize("mode,victim,timeout_s,said,bound", STARTS, ids=[m for m, *_ in STARTS])
def test_a_rank_lost_while_fz_init_starts_the_group_is_a_peer_error_naming_it(mode, victim, timeout_s, said, bound,
                                                                              tmp_path):
    """Issue 40: torch's rendezvous waited 150 s and more for a frozen store host with
    Spec.timeout_s=20, or raised a raw DistNetworkError; now a frozen rank is named within the
    timeout, and one lost after it joined (frozen or killed) within seconds (a 30 s timeout
    that does not fire)."""
    survivor = 1 - victim
    with Slowdown() as slow:
        out = run_job(mode, timeout_s, tmp_path, limit_s=timeout_s + 60, ranks=(survivor,))
    status, text = out[survivor]
    assert status == 3, (status, text[-3000:])  # not a raw DistNetworkError, not a hang
    ranks, took, msg = peer_error(text)
    assert ranks == f"[{victim}]", msg
    assert said in msg, msg
    assert took < bound + slow.margin(), (slow, msg)
    if mode == "stop_join":  # said while it waited, not only at the end
        assert "fz: rank 0 waits for rank(s) [1] to join (WORLD_SIZE=2" in text, text[-3000:]
