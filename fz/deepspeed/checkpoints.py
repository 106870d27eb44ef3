"""DeepSpeed's checkpoint calls on fz checkpoints: `save_dir/<tag>/` and a `latest` file naming the tag.

`save_checkpoint(save_dir, tag, client_state)` writes an fz checkpoint (atomic, checksummed,
pickle-free: fz.save) at `save_dir/<tag>`, then `save_dir/latest` (rank 0, atomically, once
the checkpoint is committed). `load_checkpoint(load_dir, tag=None)` restores the tag `latest`
names, or `tag`; a DeepSpeed checkpoint (DeepSpeed wrote it: `global_stepN/*_model_states.pt`)
is imported (fz.import_deepspeed), so a run moves from DeepSpeed to fz mid-way. The engine's
own counters ride in the client state under one key, taken out again on load.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

import fz
from fz.ckpt.deepspeed import files as ds_files
from fz.distributed import peers
from fz.errors import CheckpointError

log = logging.getLogger(__name__)
ENGINE_KEY = "fz.deepspeed"  # the engine's counters in the client state
LATEST = "latest"


def _write_latest(save_dir: Path, tag: str) -> None:
    tmp = save_dir / f".{LATEST}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, save_dir / LATEST)


def save(state: fz.State, save_dir: Path, tag: str, client_state: dict[str, Any], counters: dict[str, int],
         save_latest: bool) -> None:
    if ENGINE_KEY in client_state:
        raise CheckpointError(f"save_checkpoint: client_state key {ENGINE_KEY!r} is the engine's own; rename it")
    fz.save(state, save_dir / tag, client_state={**client_state, ENGINE_KEY: counters}, client_state_per_rank=True)
    if save_latest and state.plan.rank == 0:
        _write_latest(save_dir, tag)
    if dist.is_initialized() and dist.get_world_size() > 1:  # every rank sees `latest` once it returns
        peers.wait_work(dist.barrier(async_op=True))  # within Spec.timeout_s: a lost rank is an fz.PeerError


def load(state: fz.State, load_dir: Path, tag: str | None) -> tuple[fz.State, Path, dict[str, Any], dict] | None:
    """(state, path, client_state, engine counters), or None when no `latest` names a tag."""
    if tag is None:
        latest = load_dir / LATEST
        if not latest.is_file():
            log.warning("load_checkpoint: %s has no '%s' file and no tag was given: nothing loaded", load_dir, LATEST)
            return None
        tag = ds_files.latest_tag(load_dir)  # a tag folder of load_dir: DeepSpeed's would follow it anywhere
    path = load_dir / tag
    if not path.exists():
        raise CheckpointError(f"load_checkpoint: {path} does not exist (tag {tag!r} in {load_dir})")
    state, client = fz.restore(state, path, with_client_state=True)  # type: ignore[misc]  # DeepSpeed's: imported
    client = dict(client)
    counters = client.pop(ENGINE_KEY, {}) or {}
    return state, path, client, dict(counters)
