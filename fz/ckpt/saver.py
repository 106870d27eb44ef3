"""Writing one checkpoint: every rank writes its shards with DCP, then rank 0 commits it atomically.

Phases (each ends in an agreement, so a failure on one rank fails every rank promptly):
  1. prepare (caller's thread): rank 0 settles crashed leftovers and creates <name>.tmp
     (fz/ckpt/commit.py; <name> is step_<N>, or a DeepSpeed tag); an async save also copies its
     tensors to host memory here.
  2. write: DCP writes this rank's shards (`dcp.save`, or `dcp.async_save`'s thread), then
     the rank writes its data position (data_<rank>.json) and fsyncs.
  3. checksum: each rank lists its own files' checksums, taken while DCP wrote them
     (fz/ckpt/writer.py; only data_<rank>.json is read back); rank 0 gathers them.
  4. commit (rank 0): fz.json, manifest.json last, fsync the directory, rename to <name>
     (setting aside a committed copy of that name until `latest` names the new one), fsync the
     root, replace `latest`, prune to `keep_last` (fz/ckpt/commit.py).
DCP has no commit step of its own (it writes into the directory it is given and has no
manifest, rename or pruning), so phases 3-4 stay fz's; for an async save they run in a
thread the Checkpointer starts once DCP's future is done.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from fz.ckpt import commit, manifest, signing, space
from fz.ckpt.commit import Target
from fz.ckpt.group import agree, dcp_error, exchange, run_local
from fz.ckpt.index import INDEX, index_of
from fz.ckpt.layout import META, disk_full, fsync_path, write_durable
from fz.ckpt.regular import JSON_MAX
from fz.ckpt.tree import digests, encode, entries
from fz.ckpt.writer import HashingWriter
from fz.errors import CheckpointError, ConfigError
from fz.state import State, block_until_ready
from fz.storage.disk import DiskTensor, load
from fz.version import __version__

FORMAT = 1
THREADS = 1  # DCP's writer threads per rank (files per rank)


def _stage(t: Tensor) -> Tensor:
    """A host copy that later training steps (which update buffers in place) cannot touch.

    fz's own copy, not DCP's stagers: in torch 2.13 both (BlockingAsyncStager, DefaultStager)
    deep-copy each DTensor, which fails ("invalid python storage") when its local tensor is a
    view at a nonzero storage offset, as fz's bucket views are; and they would copy the bucket.
    """
    if isinstance(t, DTensor):
        if isinstance(t._local_tensor, DiskTensor):  # a snapshot on disk (the step may delete what it read)
            return DTensor(t._local_tensor.copy_to_new_blob(), t._spec, requires_grad=False)
        local = t._local_tensor.detach().to("cpu", copy=True)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return t.detach().to("cpu", copy=True)


def _on_disk(t: Tensor) -> bool:
    return isinstance(t._local_tensor if isinstance(t, DTensor) else t, DiskTensor)


def _owning(t: Tensor) -> Tensor:
    """`t`, or, when it is a view into a larger storage (fz's bucket views), the same memory as a
    tensor whose storage is exactly its bytes. DCP clones such a view before torch.save (which
    would write its whole storage): a copy of every bucket view's bytes that this avoids. The
    alias lives only while DCP writes it; the state dict DCP holds keeps `t` alive meanwhile."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or not nbytes or not t.is_contiguous() or t.untyped_storage().nbytes() == nbytes:
        return t
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(t.data_ptr()), dtype=t.dtype).view(t.shape)


class _ReadsDisk(DefaultSavePlanner):
    """DCP's planner, reading each leaf of the disk tier only when DCP writes it (one at a time),
    and handing it views as tensors of their own (no copy)."""

    def resolve_data(self, write_item):
        data = load(super().resolve_data(write_item))
        return _owning(data) if isinstance(data, Tensor) else data


class _AlreadyStaged(AsyncStager):
    """dcp.async_save's stager for tensors fz already staged (in phase 1, before agreeing)."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def close(self) -> None:
        pass


class SaveJob:
    """One save after phase 1: the tensors to write and where. `run` does phases 2-4 in the
    caller's thread; `launch` starts phase 2 in DCP's thread and `finish` does the rest."""

    def __init__(self, target: Target, step: int, tensors: dict[str, Tensor], rank_json: dict[str, Any],
                 meta: dict[str, Any], keep_last: int | None, group, rank: int, key: bytes | None = None):
        self.target, self.step, self.tensors, self.rank_json = target, step, tensors, rank_json
        self.meta, self.keep_last, self.group, self.rank = meta, keep_last, group, rank
        self.key = key  # signs the manifest; its files' checksums are then sha256
        self.algorithm = signing.ALGORITHM if key is not None else manifest.ALGORITHM
        self.tmp = target.tmp
        self.writer: HashingWriter | None = None

    def _writer(self) -> HashingWriter:
        self.writer = HashingWriter(self.tmp, self.algorithm, thread_count=THREADS)
        return self.writer

    def run(self) -> None:
        self._cleaning(self._write_and_commit)

    def launch(self) -> Future:
        """Phase 2 in dcp.async_save's thread; the staged tensors go with it (this job drops them)."""
        def go():
            try:
                return dcp.async_save(self.tensors, storage_writer=self._writer(), process_group=self.group,
                                      planner=_ReadsDisk(), async_stager=_AlreadyStaged())
            finally:
                self.tensors = {}
        return self._cleaning(go)

    def finish(self, written: Future) -> None:
        """Phases 3-4 once DCP's write is done (called from the Checkpointer's thread)."""
        def go():
            try:
                md = written.result()
            except CheckpointException as e:
                raise dcp_error(e, "writing checkpoint", self.tmp, self.rank) from e
            self._commit_all(md)
        self._cleaning(go)

    def _cleaning(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except BaseException as e:
            interrupted = isinstance(e, (KeyboardInterrupt, SystemExit))
            full = None if interrupted else disk_full(self.tmp, e)  # before the debris goes, which frees space
            if self.rank == 0:  # every rank is past its writes (failures are collective): drop the debris
                shutil.rmtree(self.tmp, ignore_errors=True)
            if full is not None:
                raise full from e
            raise

    def _write_and_commit(self) -> None:
        try:
            md = dcp.save(self.tensors, storage_writer=self._writer(), process_group=self.group, planner=_ReadsDisk())
        except CheckpointException as e:
            raise dcp_error(e, "writing checkpoint", self.tmp, self.rank) from e
        finally:
            self.tensors = {}  # on disk (or failed): free them now
        self._commit_all(md)

    def _commit_all(self, dcp_md) -> None:
        sums, err = run_local(self._write_rank_files)
        all_sums = exchange(self.group, sums, err, f"writing checkpoint {self.tmp}")
        err = None
        if self.rank == 0:
            _, err = run_local(self._commit, all_sums, dcp_md)
        agree(self.group, err, f"committing checkpoint {self.tmp}")

    def _write_rank_files(self) -> dict[str, dict]:
        name = f"data_{self.rank}.json"
        write_durable(self.tmp / name, _json(name, self.rank_json))
        mine = [n for n in os.listdir(self.tmp) if n.startswith(f"__{self.rank}_") or n == name]
        hashed = self.writer.sums() if self.writer is not None else {}
        out = {n: hashed[n] for n in mine if n in hashed}
        out.update(manifest.describe(self.tmp, sorted(n for n in mine if n not in hashed), self.algorithm))
        return out

    def _commit(self, all_sums: list[dict[str, dict]], dcp_md) -> None:
        meta = dict(self.meta, **_tensor_totals(dcp_md), created_unix=time.time())
        write_durable(self.tmp / INDEX, _json(INDEX, index_of(dcp_md)))  # what fz reads, not DCP's pickle
        write_durable(self.tmp / META, _json(META, meta, indent=1))
        files: dict[str, dict] = {}
        for s in all_sums:
            files.update(s)
        rest = sorted(n for n in os.listdir(self.tmp) if n not in files)
        for n in rest:
            fsync_path(self.tmp / n)
        files.update(manifest.describe(self.tmp, rest, self.algorithm))
        manifest.write(self.tmp, files, self.key)  # last file of the checkpoint
        fsync_path(self.tmp)
        commit.into_place(self.target, self.keep_last)


def _json(name: str, value: Any, indent: int | None = None) -> bytes:
    """`value` as checkpoint file `name`'s JSON, refused when fz.restore would not read it back
    (a metadata file is read only up to JSON_MAX bytes)."""
    data = json.dumps(value, indent=indent).encode()
    if len(data) > JSON_MAX:
        raise CheckpointError(f"fz.save: {name} would be {len(data)} bytes, over the {JSON_MAX >> 20} MiB fz.restore "
                              "reads of a metadata file: keep large values in the client state or data as tensors")
    return data


def _my_share(tensors: dict[str, Tensor], rank: int, world: int) -> dict[str, Tensor]:
    """This rank's part: its shards, plus the replicated tensors it writes (DCP would write each
    once anyway). Dropping the rest here spares an async save from staging them. Replicated
    tensors go to the least-loaded rank, largest first: the same choice on every rank."""
    if world == 1:
        return tensors
    load = [0] * world
    out: dict[str, Tensor] = {}
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


def _tensor_totals(md) -> dict[str, int]:
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


def _has_master(state: State) -> bool:
    # recorded in fz.json for `fz inspect`
    return state.master is not None


def prepare(state: State, target: Target, step: int, client_state: dict[str, Any] | None, keep_last: int | None,
            group, *, stage: bool, client_per_rank: bool = False, key: bytes | None = None) -> SaveJob:
    """Phase 1 on every rank, in the caller's thread, agreed across ranks (`step`: fz.json's).
    `stage` copies the tensors to host memory here, so a rank that cannot (out of memory) fails
    every rank before any background write starts. One `client_state` is saved for all ranks, so the
    ranks' must agree (compared by hash, on the agreement this phase ends with) unless
    `client_per_rank` saves each rank's own (in data_<rank>.json and client/<rank>/...). Every
    rank must hold the same `key` (or none): the same agreement compares their fingerprints."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    state = block_until_ready(state)  # parameters still arriving from the last step are written whole

    def local() -> tuple[SaveJob, list]:
        client_json, client_t = encode(client_state or {}, f"client/{rank}" if client_per_rank else "client")
        tensors = _my_share(dict(entries(state), **({} if client_per_rank else client_t)), rank, world)
        tensors[f"rng/{rank}"] = state.rng
        data_json, data_t = encode(state.data, f"data/{rank}")
        tensors.update(data_t)
        rank_json = {"data": data_json}
        if client_per_rank:
            tensors.update(client_t)
            rank_json["client"] = client_json
        if stage:  # room for the disk tier's copy is checked first
            tensors = space.staged(target.final, tensors, _stage)
        if rank == 0:
            commit.prepare(target)
        spec = state.spec
        meta = {"format": FORMAT, "fz_version": __version__, "torch_version": torch.__version__, "step": step,
                "train_step": int(state.step), "world": world, "stage": spec.stage, "precision": spec.precision,
                "micro_batch": spec.micro_batch, "grad_accum": spec.grad_accum,
                "master": _has_master(state), "checksum": signing.ALGORITHM if key else manifest.ALGORITHM,
                "signed": key is not None,
                "state_dict_buffers": list(state.skeleton.persistent),
                "client_state": {} if client_per_rank else client_json, "client_state_per_rank": client_per_rank}
        job = SaveJob(target, step, tensors, rank_json, meta, keep_last, group, rank, key)
        return job, [{} if client_per_rank else digests(client_json, client_t), signing.key_id(key)]

    done, err = run_local(local)
    where = target.final
    shared = exchange(group, None if done is None else done[1], err, f"preparing checkpoint {where}")
    differ = _differing_keys([hashes for hashes, _ in shared])
    keys = [key_id for _, key_id in shared]
    if differ or len(set(keys)) > 1:
        if rank == 0:
            shutil.rmtree(done[0].tmp, ignore_errors=True)
        if differ:
            raise ConfigError(
                f"saving checkpoint {where}: client_state differs between ranks in {'; '.join(differ)}. One "
                "client_state is saved for all ranks: make it the same on every rank, or pass "
                "client_state_per_rank=True to save each rank's own.")
        ranks = [r for r, k in enumerate(keys) if k != keys[0]]
        raise ConfigError(
            f"saving checkpoint {where}: the ranks were given different checkpoint keys (rank "
            f"{', '.join(map(str, ranks))} vs rank 0; {sum(k is None for k in keys)} of {len(keys)} without one). "
            f"Give every rank the same key= or {signing.ENV}.")
    return done[0]


def _differing_keys(hashes: list[dict[str, str]]) -> list[str]:
    """'key' (ranks that differ from rank 0) for each top-level client_state key the ranks disagree on."""
    keys = sorted({k for h in hashes for k in h})
    out = []
    for k in keys:
        ranks = [r for r, h in enumerate(hashes) if h.get(k) != hashes[0].get(k)]
        if ranks:
            out.append(f"{k!r} (rank {', '.join(map(str, ranks))} vs rank 0)")
    return out
