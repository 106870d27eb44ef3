"""Start-up under torchrun: without init_process_group, fz.init joins the one job torchrun started
(same losses as with it); a WORLD_SIZE without the rest is an error, never a silent one-process run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fz.testing.spawn import run_ranks

from support.helpers import train_fz

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}", OMP_NUM_THREADS="1")
for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(k, None)

SCRIPT = """
import json, os
import torch.distributed as dist
import fz
from support.helpers import train_fz
rank = int(os.environ["RANK"])
state, losses = train_fz(rank, 2, 3, 1, steps=4)  # fz.init starts the group: no init_process_group here
spec = fz.Spec.from_deepspeed({"train_micro_batch_size_per_gpu": 2})
if rank == 0:
    out = {"world": dist.get_world_size(), "losses": losses, "train_batch": spec.provenance["train_batch_size"][0]}
    print(json.dumps(out))
"""


def _with_init(rank, world):
    return train_fz(rank, world, 3, 1, steps=4)[1]


def test_torchrun_without_init_process_group_is_one_world2_job(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], env=ENV, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    want = run_ranks(2, _with_init)[0]  # the same training with init_process_group
    assert got["world"] == 2 and got["train_batch"] == 4  # from_deepspeed sees the world size too
    assert got["losses"] == want


STARTS = """
import os, fz
try:
    fz.distributed.init()
except fz.ConfigError as e:
    print("error:", e)
del os.environ["WORLD_SIZE"]
print("alone:", fz.distributed.init(), fz.distributed.implicit())
"""


def test_a_world_size_without_the_rest_is_an_error_and_no_world_size_a_group_of_one():
    out = subprocess.run([sys.executable, "-c", STARTS], env=dict(ENV, WORLD_SIZE="2"), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    error, alone = out.stdout.splitlines()
    assert error == (
        "error: WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT are not: start the processes with "
        "torchrun (it sets all of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), set them yourself, or unset "
        "WORLD_SIZE to run one process"
    )
    assert alone == "alone: (0, 1) True"
