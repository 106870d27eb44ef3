"""The README's quickstart as a user runs it, saved as a file: twice in a row in one folder (the
second run saves step 50 again, replacing the first run's checkpoint), then under torchrun with
2 processes, as the README invites, after those one-process runs."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(k, None)


def quickstart() -> str:
    """The README's first python block (the quickstart)."""
    return re.search(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), re.S | re.M).group(1)


def run(cwd: Path, *launch: str) -> str:
    out = subprocess.run([sys.executable, *launch, "quickstart.py"], cwd=cwd, env=ENV, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow  # an end-to-end script, three times (the README's own run is in test_docs)
def test_readme_quickstart_runs_twice_then_under_torchrun(tmp_path):
    (tmp_path / "quickstart.py").write_text(quickstart())
    root = tmp_path / "checkpoints" / "quickstart"
    worlds = []
    for launch in ((), (), ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")):
        out = run(tmp_path, *launch)
        assert "step 50  loss" in out and re.search(r"^50 ", out, re.M), out[-2000:]  # trained, saved, resumed
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_50"]
        worlds.append(json.loads((root / "step_50" / "fz.json").read_text())["world"])
    assert worlds == [1, 1, 2]  # each run's save replaced the one before
