"""`fz.save`: every rank writes its shards with DCP, then rank 0 commits the step atomically.

Phases (each ends in an agreement, so a failure on one rank fails every rank promptly):
  1. prepare (caller's thread): rank 0 clears crashed leftovers and creates step_<N>.tmp.
  2. write: dcp.save of this rank's shards, its data position (data_<rank>.json), fsync.
  3. checksum: each rank sums its own files; rank 0 gathers them.
  4. commit (rank 0): fz.json, manifest.json last, fsync the directory, rename to step_<N>,
     fsync the root, replace `latest`, prune to `keep_last`.
With async_=True phases 2-4 run in a background thread on a staged (copied) state; the
next save, a restore, wait_for_checkpoints() and interpreter exit wait for it.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from fz.ckpt import layout, manifest
from fz.ckpt.group import agree, ckpt_group, dcp_error, exchange, run_local
from fz.ckpt.layout import LATEST, META, PathLike, fsync_path, read_latest, step_name, write_durable
from fz.ckpt.tree import encode, entries
from fz.errors import ConfigError
from fz.state import State

FORMAT = 1


def _stage(t: Tensor) -> Tensor:
    """A host copy that later training steps (which update buffers in place) cannot touch."""
    if isinstance(t, DTensor):
        local = t._local_tensor.detach().to("cpu", copy=True)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return t.detach().to("cpu", copy=True)


def _fz_version() -> str:
    import fz
    return getattr(fz, "__version__", "unknown")


class _Job:
    """One save after phase 1: the tensors to write and where; `run` does phases 2-4."""

    def __init__(self, root: Path, step: int, tensors: Dict[str, Tensor], data_json: Any, meta: Dict[str, Any],
                 keep_last: Optional[int], group, rank: int):
        self.root, self.step, self.tensors, self.data_json = root, step, tensors, data_json
        self.meta, self.keep_last, self.group, self.rank = meta, keep_last, group, rank
        self.tmp = root / (step_name(step) + ".tmp")

    def run(self) -> None:
        try:
            self._run()
        except BaseException:
            if self.rank == 0:  # every rank is past its writes (failures are collective): drop the debris
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise

    def _run(self) -> None:
        try:
            dcp_md = dcp.save(self.tensors, storage_writer=dcp.FileSystemWriter(self.tmp, sync_files=True),
                              process_group=self.group)
        except CheckpointException as e:
            raise dcp_error(e, "writing checkpoint", self.tmp) from e
        finally:
            self.tensors = {}  # the staged copy is on disk (or failed): free it now
        sums, err = run_local(self._write_rank_files)
        all_sums = exchange(self.group, sums, err, f"writing checkpoint {self.tmp}")
        err = None
        if self.rank == 0:
            _, err = run_local(self._commit, all_sums, dcp_md)
        agree(self.group, err, f"committing checkpoint {self.tmp}")

    def _write_rank_files(self) -> Dict[str, dict]:
        write_durable(self.tmp / f"data_{self.rank}.json", json.dumps({"data": self.data_json}).encode())
        mine = [n for n in os.listdir(self.tmp) if n.startswith(f"__{self.rank}_") or n == f"data_{self.rank}.json"]
        return manifest.describe(self.tmp, sorted(mine))

    def _commit(self, all_sums: List[Dict[str, dict]], dcp_md) -> None:
        meta = dict(self.meta, **_tensor_totals(dcp_md), created_unix=time.time())
        write_durable(self.tmp / META, json.dumps(meta, indent=1).encode())
        files: Dict[str, dict] = {}
        for s in all_sums:
            files.update(s)
        rest = sorted(n for n in os.listdir(self.tmp) if n not in files)
        for n in rest:
            fsync_path(self.tmp / n)
        files.update(manifest.describe(self.tmp, rest))
        manifest.write(self.tmp, files)  # last file of the checkpoint
        fsync_path(self.tmp)
        final = self.root / step_name(self.step)
        old = None
        if final.exists():  # a committed step that `latest` does not name (checked in phase 1)
            old = self.root / (final.name + ".del")
            os.replace(final, old)
        os.replace(self.tmp, final)
        fsync_path(self.root)
        layout.replace_durable(self.root / LATEST, final.name.encode())
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        if self.keep_last is not None:
            layout.prune(self.root, self.keep_last)


def _my_share(tensors: Dict[str, Tensor], rank: int, world: int) -> Dict[str, Tensor]:
    """This rank's part: its shards, plus the replicated tensors it writes (DCP would write each
    once anyway). Dropping the rest here spares an async save from staging them. Replicated
    tensors go to the least-loaded rank, largest first: the same choice on every rank."""
    if world == 1:
        return tensors
    load, out = [0] * world, {}
    for k in sorted(tensors, key=lambda k: (-tensors[k].numel() * tensors[k].element_size(), k)):
        t = tensors[k]
        if isinstance(t, DTensor) and any(p.is_shard() for p in t.placements):
            out[k] = t
            continue
        owner = min(range(world), key=lambda r: load[r])
        load[owner] += t.numel() * t.element_size()
        if owner == rank:
            out[k] = t
    return out


def _tensor_totals(md) -> Dict[str, int]:
    out = {"tensors": 0, "bytes": 0, "model_tensors": 0, "model_bytes": 0}
    for k, m in md.state_dict_metadata.items():
        if not hasattr(m, "size"):
            continue
        nbytes = m.size.numel() * m.properties.dtype.itemsize
        out["tensors"] += 1
        out["bytes"] += nbytes
        if k.startswith("model/"):
            out["model_tensors"] += 1
            out["model_bytes"] += nbytes
    return out


def _prepare(root: Path, step: int) -> None:
    """Phase 1 on rank 0: the root exists, leftovers are gone, step_<N>.tmp is empty."""
    root.mkdir(parents=True, exist_ok=True)
    if read_latest(root) == step_name(step) and (root / step_name(step)).exists():
        raise ConfigError(f"step {step} is already the latest checkpoint in {root}; saving it again would first "
                          f"delete the only committed copy. Save under another step= or delete {root / step_name(step)}")
    layout.clean_stale(root)
    (root / (step_name(step) + ".tmp")).mkdir()
    fsync_path(root)


class _Pending:
    def __init__(self, job: _Job):
        self.job, self.error = job, None
        self.thread = threading.Thread(target=self._run, name=f"fz-ckpt-{job.step}", daemon=False)

    def _run(self) -> None:
        try:
            self.job.run()
        except BaseException as e:  # noqa: BLE001 - re-raised by wait_for_checkpoints
            self.error = e


_pending: Optional[_Pending] = None
_lock = threading.Lock()


def wait_for_checkpoints() -> None:
    """Block until a pending async save has committed; raise its error if it failed."""
    global _pending
    with _lock:
        p, _pending = _pending, None
    if p is None:
        return
    p.thread.join()
    if p.error is not None:
        raise p.error


def _wait_at_exit() -> None:
    try:
        wait_for_checkpoints()
    except BaseException as e:  # noqa: BLE001 - nobody is left to catch it
        print(f"fz: an async checkpoint failed: {type(e).__name__}: {e}", file=sys.stderr)


atexit.register(_wait_at_exit)


def save(state: State, path: PathLike, *, step: Optional[int] = None, client_state: Optional[Dict[str, Any]] = None,
         async_: bool = False, keep_last: Optional[int] = None) -> None:
    """Write `state` (and `client_state`) to `<path>/step_<N>`; every rank calls it.

    N is `step` or the state's step. `client_state` (a JSON-able dict, tensors allowed) must be
    the same on every rank. `keep_last=K` deletes older steps once this one is committed.
    `async_=True` returns once the state is copied to host memory and finishes in a
    background thread on a checkpoint-only process group; the next save or restore and
    interpreter exit wait for it. Call `wait_for_checkpoints()` before
    `dist.destroy_process_group()`, which would cut it off.
    """
    global _pending
    state.check_alive("fz.save")
    wait_for_checkpoints()
    n = int(state.step) if step is None else step
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ConfigError(f"fz.save step={step!r}: must be an integer >= 0")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ConfigError(f"fz.save keep_last={keep_last!r}: must be None or an integer >= 1")
    if client_state is not None and not isinstance(client_state, dict):
        raise ConfigError(f"fz.save client_state must be a dict, got {type(client_state).__name__}")
    group = ckpt_group(state)
    rank = dist.get_rank(group)
    root = Path(path)

    def local():
        client_json, client_t = encode(client_state or {}, "client")
        tensors = _my_share(dict(entries(state), **client_t), rank, dist.get_world_size(group))
        tensors[f"rng/{rank}"] = state.rng
        data_json, data_t = encode(state.data, f"data/{rank}")
        tensors.update(data_t)
        if async_:
            tensors = {k: _stage(t) for k, t in tensors.items()}
        if rank == 0:
            _prepare(root, n)
        spec = state.spec
        meta = {"format": FORMAT, "fz_version": _fz_version(), "torch_version": torch.__version__, "step": n,
                "train_step": int(state.step), "world": state.plan.world, "stage": spec.stage,
                "precision": spec.precision, "master": state.master is not None, "checksum": manifest.ALGORITHM,
                "client_state": client_json}
        return _Job(root, n, tensors, data_json, meta, keep_last, group, rank)

    job, err = run_local(local)
    agree(group, err, f"preparing checkpoint {root / step_name(n)}")
    if not async_:
        job.run()
        return
    pending = _Pending(job)
    with _lock:
        _pending = pending
    pending.thread.start()
