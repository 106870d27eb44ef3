"""Where the monitor's scalars go: TensorBoard event files and CSV, one sub-directory per run.

`run_dir(root, name)` is `root/<name>` (default name: the start time), so runs in one
log directory show up as separate TensorBoard runs instead of piling into one.
"""
from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import IO

from fz.storage.fresh import open_fresh

PathLike = str | Path


def run_name() -> str:
    """A run's default name: its start time."""
    return time.strftime("%Y%m%d-%H%M%S")


def run_dir(root: PathLike, name: str) -> Path:
    """`root/name`, or `root/name-2`, `-3`... if that exists (a new run never appends to an old one)."""
    root = Path(root)
    path, n = root / name, 1
    while path.exists():
        n += 1
        path = root / f"{name}-{n}"
    path.mkdir(parents=True)
    return path


class TensorBoardWriter:
    """Scalars as TensorBoard events (torch.utils.tensorboard)."""

    def __init__(self, path: Path):
        from torch.utils.tensorboard import SummaryWriter
        self.path = path
        self.writer = SummaryWriter(str(path))

    def write(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class CsvWriter:
    """Scalars as rows `step,tag,value` of `scalars.csv` (DeepSpeed's csv_monitor)."""

    def __init__(self, path: Path):
        self.path = path
        file = open_fresh(path / "scalars.csv", "w", newline="", encoding="utf-8")  # a planted link: unfollowed
        self.file: IO[str] | None = file
        self.rows = csv.writer(file)
        self.rows.writerow(["step", "tag", "value"])

    def write(self, scalars: dict[str, float], step: int) -> None:
        if self.file is None:
            raise ValueError(f"I/O operation on closed file: {self.path / 'scalars.csv'} (the writer was closed)")
        self.rows.writerows([step, tag, repr(float(value))] for tag, value in scalars.items())
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
