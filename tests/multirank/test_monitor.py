"""The Monitor writes every listed scalar to TensorBoard and CSV (a sub-directory per run), per-rank
memory, a progress bar on a terminal and plain lines elsewhere; saves and restores say what they did."""
from __future__ import annotations

import csv
import io
import re

import pytest

import fz
from fz.testing.spawn import run_ranks

from support.helpers import CFG, MICRO, make_model, rank_batches, spec

STEPS, EVERY = 4, 2
TRAIN = ("train/loss", "train/lr", "train/grad_norm", "train/loss_scale", "train/skipped_steps")
PERF = ("perf/step_time_s", "perf/samples_per_s", "perf/tokens_per_s")
MEMORY = (
    "params_mb",
    "grads_mb",
    "optimizer_mb",
    "total_mb",
    "device_mb",
    "host_mb",
    "disk_mb",
    "peak_rss_mb",
    "device_peak_mb",
    "pinned_mb",
)


def _train(rank, world, root):
    state = fz.init(make_model(), spec(3, 1, precision="fp16", loss_scaling=fz.LossScale(initial_scale_power=4)))
    monitor = fz.Monitor(f"{root}/tb", EVERY, STEPS, csv_dir=f"{root}/csv", run="run1", stream=io.StringIO())
    losses = []
    for per_rank in rank_batches(world, 1, STEPS):
        state, loss = fz.train_step(state, per_rank[rank])
        monitor(state, loss, per_rank[rank])
        losses.append(float(loss))
    monitor.close()
    return losses, monitor.dirs, monitor.stream.getvalue()


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    root = tmp_path_factory.mktemp("monitor")
    return root, run_ranks(2, _train, str(root), timeout=180)


def test_tensorboard_and_csv_hold_every_scalar(world2):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, ranks = world2
    losses, dirs, _ = ranks[0]
    assert dirs == [str(root / "tb" / "run1"), str(root / "csv" / "run1")] and ranks[1][1] == []  # rank 0 writes
    said = ranks[0][2]  # rank 0's close says where the scalars went (the examples print it so)
    assert f"fz: TensorBoard scalars in {dirs[0]} (tensorboard --logdir {root / 'tb'})\n" in said, said[-500:]
    assert f"fz: scalars in {dirs[1]}/scalars.csv\n" in said and "fz: " not in ranks[1][2]
    want = set(TRAIN + PERF) | {f"memory/rank{r}/{m}" for r in (0, 1) for m in MEMORY}
    events = EventAccumulator(dirs[0])
    events.Reload()
    assert set(events.Tags()["scalars"]) == want
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [2, 4]
    assert [e.value for e in loss] == pytest.approx([sum(losses[:2]) / 2, sum(losses[2:]) / 2], rel=1e-6)
    rows = list(csv.DictReader(open(f"{dirs[1]}/scalars.csv")))
    assert {r["tag"] for r in rows} == want and {r["step"] for r in rows} == {"2", "4"}
    by = {(r["tag"], r["step"]): float(r["value"]) for r in rows}
    rows_per_step, tokens_per_step = 2 * MICRO, 2 * MICRO * (CFG.seq + 1)
    assert by["perf/tokens_per_s", "4"] == pytest.approx(
        by["perf/samples_per_s", "4"] * tokens_per_step / rows_per_step
    )
    assert by["train/loss_scale", "4"] == 2.0**4 and by["train/skipped_steps", "4"] == 0
    assert by["train/grad_norm", "4"] > 0 and by["memory/rank1/optimizer_mb", "4"] > 0
    assert by["memory/rank0/peak_rss_mb", "4"] > by["memory/rank0/total_mb", "4"]
    assert (
        by["memory/rank0/device_mb", "4"] > 0
        and by["memory/rank0/host_mb", "4"] == by["memory/rank0/disk_mb", "4"] == 0
    )


def test_not_a_terminal_gets_plain_lines_and_a_terminal_a_progress_bar(world2, tmp_path):
    _, ranks = world2
    lines = [ln for ln in ranks[0][2].splitlines() if not ln.startswith("fz: ")]  # close's lines: tested above
    assert [ln.split("  ")[0] for ln in lines] == ["step 2/4", "step 4/4"] and "\r" not in ranks[0][2]
    assert ranks[1][2] == ""

    class Tty(io.StringIO):
        def isatty(self):
            return True

    state = fz.init(make_model(), spec(0, 1))
    out = Tty()
    monitor = fz.Monitor(None, 2, total_steps=3, stream=out, memory=False)
    for per_rank in rank_batches(1, 1, 3):
        state, loss = fz.train_step(state, per_rank[0])
        monitor(state, loss, per_rank[0])
    monitor.log({"eval/loss": 1.5}, 3)
    monitor.close()
    text = out.getvalue()
    assert re.search(r"\r\x1b\[2K3/3 \[#+ *\] loss \d\.\d{4}  [\d,]+ tok/s  ETA 0:00", text), text
    assert "step 3  eval/loss 1.5\n" in text and text.endswith("\n")


def test_each_run_gets_its_own_directory(tmp_path):
    a = fz.Monitor(str(tmp_path), run="same", stream=io.StringIO())
    b = fz.Monitor(str(tmp_path), run="same", stream=io.StringIO())
    c = fz.Monitor(str(tmp_path), stream=io.StringIO())
    for m in (a, b, c):
        m.close()
    assert a.dirs == [str(tmp_path / "same")] and b.dirs == [str(tmp_path / "same-2")]
    assert re.fullmatch(r"\d{8}-\d{6}", c.dirs[0].rsplit("/", 1)[1])


def test_save_and_restore_report_bytes_and_seconds(tmp_path, capsys):
    state = fz.init(make_model(), spec(0, 1))
    fz.save(state, tmp_path)
    fz.restore(fz.init(make_model(), spec(0, 1)), tmp_path)
    with fz.Checkpointer(tmp_path / "quiet", verbose=False) as ckpt:
        ckpt.save(state)
    out = capsys.readouterr().out
    assert re.search(rf"^fz: saved {re.escape(str(tmp_path))}/step_0 \(\d+\.\d MB in \d+\.\d\d s\)$", out, re.M), out
    assert re.search(rf"^fz: restored {re.escape(str(tmp_path))}/step_0 \(\d+\.\d MB in \d+\.\d\d s\)$", out, re.M)
    assert "quiet" not in out


def test_deepspeed_monitor_keys_reach_the_monitor_through_the_spec():
    spec = fz.Spec.from_deepspeed({"tensorboard": {"enabled": True, "output_path": "tb", "job_name": "j"},
                                   "csv_monitor": {"enabled": True, "output_path": "csv", "job_name": "j"},
                                   "steps_per_print": 7})
    assert fz.Monitor.settings_of(spec) == {"log_dir": "tb/j", "csv_dir": "csv/j", "log_every": 7}
    assert fz.Monitor.settings_of(fz.Spec.from_deepspeed({})) == {"log_dir": None, "csv_dir": None, "log_every": 10}
    assert fz.Monitor.settings_of(fz.Spec()) == {}
    monitor = fz.Monitor.from_spec(spec.replace(stage=1), log_dir=None, csv_dir=None, stream=io.StringIO())
    assert (monitor.log_every, monitor.writers) == (7, [])  # the config's interval; keywords win over its dirs
    monitor.close()
    explained = spec.explain()
    assert re.search(r"^  monitor\.log_every +config +steps_per_print +7$", explained, re.M), explained
    assert re.search(r"^  monitor\.log_dir +config +tensorboard\.output_path / job_name +'tb/j'$", explained, re.M)
    with pytest.raises(fz.ConfigError, match=r"^Spec\(log_dir=\.\.\.\): monitoring is no longer in the Spec .*"
                       r"pass it to fz\.Monitor\(log_dir=\.\.\.\)"):
        fz.Spec(stage=1, log_dir="runs")
    with pytest.raises(fz.ConfigError, match=r"^Spec\(log_every=\.\.\.\): .*fz\.Monitor\(log_every=\.\.\.\)"):
        fz.Spec().replace(log_every=5)
    with pytest.raises(fz.ConfigError, match=r"^fz\.Monitor\(log_every=0\): must be an integer >= 1"):
        fz.Monitor(log_every=0)
    assert "csv_monitor" not in " ".join(spec.provenance.unsupported)
