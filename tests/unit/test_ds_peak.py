"""Reading a DeepSpeed checkpoint holds one chunk, not the model: peak RSS of a ~200 MB ZeRO-3 checkpoint.

The checkpoint is synthetic (tests/support/ds_synth.py: DeepSpeed is not needed to make one of
any size), so the first test checks its files have the structure of a real fixture's, pickle
for pickle; the values fz reads back are the writer's formula.
"""
from __future__ import annotations

import json
import math
import pickletools
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from fz.ckpt.deepspeed import unpickle as ds_pickle
from fz.ckpt.deepspeed.checkpoint import DeepSpeedCheckpoint
from fz.ckpt.deepspeed.unpickle import DSObject, Lazy
from tests.support import ds_synth

DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed"
ROOT = Path(__file__).resolve().parents[2]
LIMIT_MB = 64


def _structure(x: Any, key: str = "") -> Any:
    """The shape of a loaded file: keys, types, DeepSpeed classes, tensor ranks and dtypes (not values)."""
    if key in ("ds_config", "param_groups", "lr_scheduler"):
        return type(x).__name__
    if isinstance(x, DSObject):
        return ("obj", x.cls, sorted(x.state))
    if isinstance(x, Lazy):
        return ("tensor", x.dtype, len(x.shape))
    if isinstance(x, dict):
        return (type(x).__name__, [(k, _structure(v, str(k))) for k, v in x.items()
                                   if k != "note"])
    if isinstance(x, list | tuple):
        return ("seq", [_structure(v) for v in x[:1]])
    return type(x).__name__


def _globals(f: Path) -> set[str]:
    with zipfile.ZipFile(f) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    return {f"{op.name} {arg}" for op, arg, _ in pickletools.genops(data) if op.name in ("GLOBAL", "STACK_GLOBAL")}


def test_synthetic_layout_is_deepspeeds(tmp_path: Path) -> None:
    real = DeepSpeedCheckpoint(DATA / "stage3_fp32" / "ckpt")
    params = list(real.params.items())
    ds_synth.write(tmp_path / "global_step3", params, 2, frozen=list(real.frozen.items()), tied=real.shared)
    for f in sorted(real.path.glob("*.pt")):
        mine = tmp_path / "global_step3" / f.name
        assert _globals(mine) == _globals(f), f.name
        a, b = _structure(ds_pickle.load(mine)), _structure(ds_pickle.load(f))
        assert a == b, f.name
    synth = DeepSpeedCheckpoint(tmp_path)
    assert (synth.stage, synth.world, synth.params, synth.optimizer_step) == (3, 2, real.params, 3)
    assert (synth.frozen, synth.shared) == (real.frozen, real.shared)


def test_synthetic_values_across_sub_groups(tmp_path: Path) -> None:
    params = [("a", (37, 12)), ("b", (35,)), ("c", (12, 35)), ("d", (7,))]
    ds_synth.write(tmp_path / "global_step1", params, 3, frozen=[("f", (5, 5))], sub_group_size=200)
    ck = DeepSpeedCheckpoint(tmp_path)
    assert ck.world == 3 and len(ds_synth.sub_groups(params, 3, 200)) > 1
    for j, (name, shape) in enumerate(params):
        for kind in ds_synth.KINDS:
            got = torch.cat([c for _, c in ck.read(name, kind)])
            assert torch.equal(got, ds_synth.value(kind, j, torch.arange(math.prod(shape)))), (name, kind)
    assert torch.equal(torch.cat([c for _, c in ck.read("f")]), ds_synth.value("fp32", -1, torch.arange(25)))


_WORKER = r"""
import json, sys, torch
from pathlib import Path
from fz.ckpt.deepspeed.checkpoint import DeepSpeedCheckpoint
from fz.ckpt.export import consolidate
from tests.support.peak_worker import rss
torch.set_num_threads(1)
src, out, small = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
consolidate(small, out.with_name("warm.safetensors"))  # what a first call imports and sets up
try:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
except OSError:
    pass
base = rss("VmRSS")
ck = DeepSpeedCheckpoint(src)
total = 0
for name in [*ck.params, *ck.frozen]:
    for kind in ("fp32", *(ck.moments if name in ck.params else ())):
        for at, chunk in ck.read(name, kind):
            total += chunk.numel()
after_read = rss("VmHWM")
consolidate(src, out)
print(json.dumps({"base": base, "read": after_read - base, "all": rss("VmHWM") - base, "elements": total}))
"""


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[str, tuple[int, ...]]]]:
    """~200 MB of fp32 masters (50M parameters, the largest 4 MB) at world 2, in 3 sub-groups."""
    params = [(f"layers.{i}.weight", (1024, 1024)) for i in range(47)] + [("head.weight", (1023, 1001)),
                                                                          ("head.bias", (333,))]
    d = tmp_path_factory.mktemp("ds_big")
    ds_synth.write(d / "global_step7", params, 2, frozen=[("frozen", (1000, 7))], sub_group_size=20_000_000, step=7)
    return d, params


def test_peak_rss_is_one_chunk(big: tuple[Path, list[tuple[str, tuple[int, ...]]]], tmp_path: Path) -> None:
    d, params = big
    out = tmp_path / "out.safetensors"
    r = subprocess.run([sys.executable, "-c", _WORKER, str(d), str(out), str(DATA / "stage3_fp32" / "ckpt")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT),
                                                                                  "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    numel = sum(math.prod(s) for _, s in params)
    assert numel * 4 > 195e6 and got["elements"] == 3 * numel + 7000
    assert got["read"] < LIMIT_MB << 20 and got["all"] < LIMIT_MB << 20, got
    from fz.ckpt.hf.weights import WeightFiles, read
    entries = WeightFiles(out).entries
    assert len(entries) == len(params) + 2
    for j, (name, shape) in enumerate(params):
        assert entries[name].shape == shape
        n = math.prod(shape)
        for lo in (0, n - 5):
            chunk = next(read(entries[name], lo, lo + 5))[1]
            assert torch.equal(chunk, ds_synth.value("fp32", j, torch.arange(lo, lo + 5))), name


_IMPORT_WORKER = r"""
import json, sys, torch
from pathlib import Path
from torch import nn
import fz
from tests.support.peak_worker import rss
torch.set_num_threads(1)
src = Path(sys.argv[1])
shapes = json.loads(sys.argv[2])


class Holder(nn.Module):  # the synthetic checkpoint's names and shapes
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Module() for _ in range(47))
        for i, m in enumerate(self.layers):
            m.weight = nn.Parameter(torch.empty(shapes[f"layers.{i}.weight"]))
        self.head = nn.Module()
        self.head.weight = nn.Parameter(torch.empty(shapes["head.weight"]))
        self.head.bias = nn.Parameter(torch.empty(shapes["head.bias"]))
        self.frozen = nn.Parameter(torch.empty(1000, 7), requires_grad=False)


model = Holder()  # never read: the import overwrites every value
state = fz.init(model, fz.Spec(stage=3, optimizer=fz.optim.adamw(lr=1e-3)))
state, _ = fz.import_deepspeed(state, src)  # the first import touches every page of the state
Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
base = rss("VmRSS")
state, client = fz.import_deepspeed(state, src)
extra = rss("VmHWM") - base
full = fz.full_params(state)
print(json.dumps({"extra": extra, "state": base, "step": int(state.step),
                  "first": full["layers.0.weight"].flatten()[:5].tolist(), "bias": full["head.bias"][-3:].tolist()}))
"""


def test_importing_into_a_state_adds_one_chunk_not_the_model(big, tmp_path: Path) -> None:
    """fz.import_deepspeed into a ZeRO-3 state (world 1) of the ~200 MB checkpoint: beyond the state
    itself (params and both moments, ~600 MB), the import's peak adds less than LIMIT_MB."""
    d, params = big
    shapes = json.dumps(dict(params))
    r = subprocess.run([sys.executable, "-c", _IMPORT_WORKER, str(d), shapes], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["state"] > 600e6 and got["extra"] < LIMIT_MB << 20, got
    assert got["step"] == 7
    assert got["first"] == ds_synth.value("fp32", 0, torch.arange(5)).tolist()
    n = params[-1][1][0]
    assert got["bias"] == ds_synth.value("fp32", len(params) - 1, torch.arange(n - 3, n)).tolist()
