"""`Monitor`: scalars to TensorBoard and CSV, a progress bar, all outside the pure step.

    monitor = fz.Monitor.from_spec(spec, total_steps=1000)   # every rank makes the same calls
    for batch in loader:
        state, loss = fz.train_step(state, batch)
        monitor(state, loss, batch)
    monitor.close()

Every `log_every` steps (and at `total_steps`) rank 0 writes, under a run sub-directory
of `log_dir` (TensorBoard) and of `csv_dir` (`scalars.csv`):
- train/loss (mean over the steps since the last log), train/lr, train/grad_norm (global,
  before clipping; when clipping is on), train/loss_scale (fp16) and train/skipped_steps;
- perf/step_time_s, perf/samples_per_s, perf/tokens_per_s (global: every rank's rows);
- memory/rank<r>/{params,grads,optimizer,total}_mb (fz.memory_report: model states this
  rank holds), the same bytes by tier, memory/rank<r>/{device,host,disk}_mb (offload), and
  memory/rank<r>/peak_rss_mb (the process's peak resident memory), device_peak_mb
  (torch.cuda.max_memory_allocated; 0 off CUDA) and pinned_mb (pinned host buffers).
The memory scalars gather one small tensor from every rank at those steps (a collective:
every rank calls the monitor). On a terminal rank 0 shows a progress bar (steps, loss,
tokens/s, ETA); elsewhere it prints a line per log instead.
"""
from __future__ import annotations

import math
import resource
import sys
import time
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch import Tensor

from fz.compat import all_gather_single
from fz.config.keys import STEPS_PER_PRINT
from fz.errors import ConfigError
from fz.observe.memory import memory_report
from fz.observe.progress import Bar
from fz.observe.writers import CsvWriter, TensorBoardWriter, run_dir, run_name
from fz.sharding.settle import Handle
from fz.spec import Spec
from fz.state import State
from fz.step.batches import batch_leaves

_MB = 2**20
MEMORY = ("params", "grads", "optimizer", "total", "device", "host", "disk", "peak_rss", "device_peak", "pinned")
TIERS = ("device", "host", "disk")
MONITOR_SETTINGS = ("log_dir", "log_every", "csv_dir")  # what a DeepSpeed config may set (Monitor.from_spec)


def peak_rss() -> int:
    """This process's peak resident set size, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def batch_counts(batch: Any) -> tuple[int, int | None]:
    """(rows, tokens) of this rank's batch: the leading dimension, and the elements of its first
    integer tensor of rows x positions (token ids; None if it has none: a model of features with
    one class label per row takes no tokens, and gets no tokens/s)."""
    leaves = [x for x in batch_leaves(batch) if isinstance(x, Tensor) and x.dim()]
    if not leaves:
        return 0, None
    ids = next((x for x in leaves if x.dim() >= 2 and not x.is_floating_point() and not x.is_complex()
                and x.dtype != torch.bool), None)
    return leaves[0].shape[0], None if ids is None else ids.numel()


class Monitor:
    """Logs a training run (rank 0 writes); see the module docstring for what and where."""

    def __init__(self, log_dir: str | None = None, log_every: int = STEPS_PER_PRINT, total_steps: int | None = None, *,
                 csv_dir: str | None = None, run: str | None = None, progress: bool | None = None,
                 memory: bool = True, stream: TextIO = sys.stdout):
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
            raise ConfigError(f"fz.Monitor(log_every={log_every!r}): must be an integer >= 1 (steps between logs)")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.log_every, self.total, self.stream, self.memory = log_every, total_steps, stream, memory
        self.run = run or run_name()
        self.writers: list[Any] = []
        self.bar: Bar | None = None
        if self.rank == 0:
            if log_dir:
                self.writers.append(TensorBoardWriter(run_dir(log_dir, self.run)))
            if csv_dir:
                self.writers.append(CsvWriter(run_dir(csv_dir, self.run)))
            self.bar = Bar(total_steps, stream, progress)
        self._reset(time.perf_counter())

    @classmethod
    def from_spec(cls, spec: Spec, total_steps: int | None = None, **kw: Any) -> Monitor:
        """A Monitor for a Spec read from a DeepSpeed config: its tensorboard, csv_monitor and
        steps_per_print (recorded as monitor.* in the Spec's provenance) give log_dir, csv_dir
        and log_every; keywords given here win. A Spec written in code has none: defaults."""
        return cls(total_steps=total_steps, **{**cls.settings_of(spec), **kw})

    @staticmethod
    def settings_of(spec: Spec) -> dict[str, Any]:
        """{log_dir, log_every, csv_dir: value} that `spec`'s DeepSpeed config set (none for a Spec
        written in code)."""
        prov = getattr(spec, "provenance", None)
        return {name: prov[f"monitor.{name}"][0] for name in MONITOR_SETTINGS
                if prov is not None and f"monitor.{name}" in prov}

    @property
    def dirs(self) -> list[str]:
        """The run directories written to (rank 0; empty elsewhere)."""
        return [str(w.path) for w in self.writers]

    def _reset(self, now: float) -> None:
        self.t0, self.steps, self.loss, self.rows = now, 0, 0.0, 0
        self.tokens: int | None = 0  # None once a batch without token ids came

    def __call__(self, state: State, loss: Tensor, batch: Any = None, *, tokens: int | None = None,
                 rows: int | None = None) -> None:
        """Account one step (this rank's `batch` gives samples and tokens; `tokens=` and `rows=`
        override them, e.g. for a step whose micro-batches came one at a time)."""
        step = int(state.step)
        self.steps += 1
        self.loss += float(loss)
        if batch is not None or rows is not None:
            n_rows, ids = batch_counts(batch) if batch is not None else (0, None)
            self.rows += (rows if rows is not None else n_rows) * self.world
            n = tokens if tokens is not None else ids
            self.tokens = None if n is None or self.tokens is None else self.tokens + n * self.world
        if step % self.log_every == 0 or step == self.total:
            self._log(state, step)
        elif self.bar is not None:
            self.bar.show(step, f"loss {float(loss):.4f}")

    def _log(self, state: State, step: int) -> None:
        now = time.perf_counter()
        took = max(now - self.t0, 1e-9)
        m = state.metrics
        scalars: dict[str, float] = {"train/loss": self.loss / self.steps}
        for key, tag in (("lr", "train/lr"), ("grad_norm", "train/grad_norm")):
            if not math.isnan(float(m[key])):
                scalars[tag] = float(m[key])
        if state.scaler is not None and "scale" in state.scaler:
            scalars["train/loss_scale"] = float(m["loss_scale"])
        scalars["train/skipped_steps"] = float(m["skipped"])
        scalars["perf/step_time_s"] = took / self.steps
        if self.rows:
            scalars["perf/samples_per_s"] = self.rows / took
            if self.tokens:
                scalars["perf/tokens_per_s"] = self.tokens / took
        if self.memory:
            scalars.update(self._memory(state))
        if self.bar is not None:  # rank 0
            self.log(scalars, step, _console=False)
            self.bar.show(step, _brief(scalars))
            if not self.bar.enabled:
                self.bar.write(f"step {step}{f'/{self.total}' if self.total else ''}  {_line(scalars)}")
        self._reset(time.perf_counter())

    def _memory(self, state: State) -> dict[str, float]:
        r = memory_report(state)
        tiers = [sum(r.tiers.get(t, {}).values()) for t in TIERS]
        mine = torch.tensor([r.params, r.grads, r.opt, r.total, *tiers, peak_rss(), r.device_peak, r.pinned],
                            dtype=torch.float64,
                            device=state.plan.device)
        every = mine
        if self.world > 1:
            every = mine.new_zeros(self.world * len(MEMORY))
            Handle([every, mine]).add(all_gather_single(every, mine, async_op=True)).wait()  # within Spec.timeout_s
        rows = every.view(self.world, len(MEMORY)).tolist()
        return {
            f"memory/rank{rank}/{name}_mb": v / _MB for rank, row in enumerate(rows) for name, v in zip(MEMORY, row)
        }

    def log(self, scalars: dict[str, float], step: int, _console: bool = True) -> None:
        """Write extra scalars (e.g. {"eval/loss": x}) at `step`; rank 0 writes, other ranks do nothing."""
        if self.rank != 0:
            return
        for w in self.writers:
            w.write(scalars, step)
        if _console and self.bar is not None:  # made on rank 0
            self.bar.write(f"step {step}  " + "  ".join(f"{k} {v:.4g}" for k, v in scalars.items()))

    def close(self) -> None:
        """Flush and close the writers; rank 0 then says where the run's scalars went."""
        for w in self.writers:
            w.close()
        if self.bar is not None:
            self.bar.close()
        for w in self.writers:
            if isinstance(w, TensorBoardWriter):
                self.stream.write(f"fz: TensorBoard scalars in {w.path} (tensorboard --logdir {w.path.parent})\n")
            else:
                self.stream.write(f"fz: scalars in {w.path / 'scalars.csv'}\n")


def _brief(scalars: dict[str, float]) -> str:
    out = f"loss {scalars['train/loss']:.4f}"
    if "perf/tokens_per_s" in scalars:
        out += f"  {scalars['perf/tokens_per_s']:,.0f} tok/s"
    return out


def _line(scalars: dict[str, float]) -> str:
    shown = [(k.split("/")[-1], v) for k, v in scalars.items() if not k.startswith("memory/")]
    return "  ".join(f"{k} {v:.4g}" for k, v in shown)
