"""fz's index of a checkpoint's tensors, in JSON, and a DCP storage reader that executes nothing.

DCP keeps its index in `.metadata`, a pickle: unpickling a downloaded checkpoint can run any
code. fz writes the same facts to `index.json` (each tensor's dtype, size and chunks, and where
each chunk's bytes are) and reads only that; DCP's `.metadata` stays beside it for other tools.
Each chunk in the data files is one `torch.save` record, a zip of a small pickle and the raw
storage: `chunk.py` takes the raw bytes and reads the pickle's opcodes without running them.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from fz.ckpt.chunk import read_chunk
from fz.ckpt.regular import MAX_DIMS, inside, parse_json, plain_name, read_regular, stat_regular
from fz.errors import CheckpointError, ConfigError

INDEX = "index.json"
INDEX_FORMAT = 1
_MAX_PAIRS = 1_000_000  # chunk pairs compared to prove a tensor's chunks do not overlap (bounded time)
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2)}


def index_of(md: Metadata) -> dict[str, Any]:
    """The JSON-able index of DCP's global metadata (as `dcp.save` returns it on rank 0)."""
    chunks: dict[str, list[dict]] = {}
    for idx, info in (md.storage_data or {}).items():
        if info.transform_descriptors:
            raise CheckpointError(f"fz.save: DCP stored {idx.fqn!r} with transforms {info.transform_descriptors}; "
                              "fz's index does not describe them")
        chunks.setdefault(idx.fqn, []).append({"offsets": list(idx.offset), "file": info.relative_path,
                                               "at": info.offset, "length": info.length})
    tensors = {}
    for key, m in md.state_dict_metadata.items():
        if not isinstance(m, TensorStorageMetadata):
            raise ConfigError(f"fz.save: {key!r} is not a tensor ({type(m).__name__}); fz saves only tensors")
        where = {tuple(c["offsets"]): c for c in chunks.get(key, [])}
        rows = []
        for c in m.chunks:
            w = where.get(tuple(c.offsets))
            if w is None:
                raise CheckpointError(f"fz.save: DCP wrote no bytes for {key!r} at {list(c.offsets)}")
            rows.append(dict(w, sizes=list(c.sizes)))
        tensors[key] = {"dtype": str(m.properties.dtype).removeprefix("torch."), "size": list(m.size), "chunks": rows}
    return {"format": INDEX_FORMAT, "tensors": tensors}


def read_index(directory: Path) -> dict[str, Any]:
    """index.json of a checkpoint, checked for shape (never DCP's pickled .metadata)."""
    path = Path(directory) / INDEX
    if not path.exists():
        if (Path(directory) / ".metadata").exists():
            raise CheckpointError(
                f"checkpoint {directory} has no {INDEX}: only DCP's .metadata, a pickle, which fz never reads "
                "(unpickling can run code from the file). It was written by an older fz or by DCP itself; if you "
                "trust where it came from, load it with torch.distributed.checkpoint and save it again with fz.save")
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        index = parse_json(read_regular(inside(directory, path)), f"checkpoint file {path}")
        _check(index)
        _in_files(Path(directory), index)
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"checkpoint file {path} is unreadable or damaged ({type(e).__name__}: {e})") from e
    return index


def _listed(directory: Path) -> set[str] | None:
    """The files the folder's manifest lists (None: it has none, as DCP's own folders)."""
    from fz.ckpt import manifest  # its layout helpers import nothing of the index's

    if not (directory / manifest.MANIFEST).exists():
        return None
    return set(manifest.read(directory))


MAX_CHUNKS = 1 << 22  # chunks of one checkpoint: a save writes about one per rank and tensor (or bucket)
MAX_TENSOR_CHUNKS = 1 << 17  # chunks of one tensor: one per rank holding a shard, 4 x a 32768-rank run


def _in_files(directory: Path, index: dict[str, Any]) -> None:
    """Each chunk's record is its own bytes of a regular file of the folder that its manifest
    lists (so its checksum was checked), inside its end: the tensors restore allocates are
    bounded by the bytes on disk (a record claims at least its values' bytes: `_check`), not by
    what the index says."""
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for key, t in index["tensors"].items():
        for c in t["chunks"]:
            spans.setdefault(c["file"], []).append((c["at"], c["length"], key))
    listed = _listed(directory)
    for name in spans:
        if not plain_name(name):
            raise ValueError(f"a chunk's file {name!r:.80} is not a plain file name of the folder")
        if listed is not None and name not in listed:
            raise CheckpointError(f"checkpoint file {directory / INDEX} names {name!r:.80}, a file its manifest does "
                                  "not list (whose checksum no one checked): damaged or altered")
    for name, found in spans.items():
        size = stat_regular(inside(directory, directory / name)).st_size
        found.sort()
        end = 0
        for at, length, key in found:
            if at < end:
                raise ValueError(f"{key!r:.100}: its chunk at byte {at} of {name} overlaps another's record")
            end = at + length
        if end > size:  # the data file's fault as much as the index's: named as the file read
            raise CheckpointError(f"checkpoint file {directory / name} is unreadable: {size} bytes, but a chunk of "
                                  f"index.json ends at byte {end}, past its {size} bytes (truncated, or not this "
                                  "checkpoint's)")


def _check(index: Any) -> None:
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT or not isinstance(index.get("tensors"), dict):
        raise ValueError(f"not an fz index of format {INDEX_FORMAT}")
    for key, t in index["tensors"].items():  # counted before any chunk is looked at (bounded time)
        if not isinstance(t, dict) or not isinstance(t.get("chunks"), list):
            raise ValueError(f"{key!r:.100}: not an object with a list of chunks")
        if len(t["chunks"]) > MAX_TENSOR_CHUNKS:
            raise ValueError(f"{key!r:.100}: {len(t['chunks'])} chunks, more than the {MAX_TENSOR_CHUNKS} of a tensor "
                             "fz.save writes (one per rank holding a shard)")
    if sum(len(t["chunks"]) for t in index["tensors"].values()) > MAX_CHUNKS:
        raise ValueError(f"more than {MAX_CHUNKS} chunks: not what fz.save writes")
    for key, t in index["tensors"].items():
        if t["dtype"] not in DTYPES:
            raise ValueError(f"{key!r:.100}: unknown dtype {t['dtype']!r:.40}")
        item = DTYPES[t["dtype"]].itemsize
        if not isinstance(t["size"], list) or len(t["size"]) > MAX_DIMS \
                or any(not isinstance(n, int) or n < 0 for n in t["size"]):
            raise ValueError(f"{key!r:.100}: bad size {t['size']!r:.100} (a list of at most {MAX_DIMS} integers >= 0)")
        ndim = len(t["size"])
        for c in t["chunks"]:
            fields = (c["offsets"], c["sizes"])
            if any(len(f) != ndim or any(not isinstance(n, int) or n < 0 for n in f) for f in fields) \
                    or any(o + s > n for o, s, n in zip(c["offsets"], c["sizes"], t["size"])):
                raise ValueError(f"{key!r:.100}: chunk {c!r:.200} does not fit size {t['size']!r}")
            if (
                not isinstance(c["file"], str)
                or "/" in c["file"]
                or c["file"].startswith(".")
                or not isinstance(c["at"], int)
                or not isinstance(c["length"], int)
                or c["at"] < 0
                or c["length"] <= 0
            ):
                raise ValueError(f"{key!r:.100}: bad location {c!r:.200}")
            if math.prod(c["sizes"]) * item > c["length"]:  # a record holds its values' bytes and more
                raise ValueError(f"{key!r:.100}: a chunk of {c['sizes']} {t['dtype']} values in a record of "
                                 f"{c['length']} bytes")
        _covered(key, t["size"], [(c["offsets"], c["sizes"]) for c in t["chunks"]])


def _covered(key: str, size: list[int], boxes: list[tuple[list[int], list[int]]]) -> None:
    """The chunks (offsets, sizes), each inside `size`, tile the tensor: as many values as it has
    and no two overlapping. A value no chunk holds would keep the template's, silently."""
    total = math.prod(size)
    boxes = [b for b in boxes if math.prod(b[1])]
    have = sum(math.prod(s) for _, s in boxes)
    if have != total:
        raise ValueError(f"{key!r:.100}: its chunks hold {have} values, the tensor {size} has {total}: "
                         + ("some values are in no chunk" if have < total else "chunks overlap"))
    if not size:
        return  # a scalar: its one chunk
    boxes.sort(key=lambda b: b[0])
    active: list[tuple[list[int], list[int]]] = []
    pairs = 0
    for o, s in boxes:  # a sweep along dim 0: compare only chunks whose rows meet
        active = [(ao, az) for ao, az in active if ao[0] + az[0] > o[0]]
        pairs += len(active)
        if pairs > _MAX_PAIRS:
            raise ValueError(f"{key!r:.100}: {len(boxes)} chunks overlap in rows too much to check")
        for ao, az in active:
            if all(a < b + n and b < a + m for a, m, b, n in zip(ao, az, o, s)):
                raise ValueError(f"{key!r:.100}: chunks at {ao} and {o} overlap, so some values are in no chunk")
        active.append((o, s))


def metadata_of(index: dict[str, Any]) -> Metadata:
    """DCP's Metadata, rebuilt from the index (for DCP's planners)."""
    sd: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for key, t in index["tensors"].items():
        chunks = []
        for c in t["chunks"]:
            chunks.append(ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"])))
            storage[MetadataIndex(key, torch.Size(c["offsets"]))] = _StorageInfo(c["file"], c["at"], c["length"])
        sd[key] = TensorStorageMetadata(TensorProperties(dtype=DTYPES[t["dtype"]]), torch.Size(t["size"]), chunks)
    return Metadata(sd, planner_data={k: (k,) for k in sd}, storage_data=storage, storage_meta=StorageMeta())


class SafeReader(dcp.FileSystemReader):
    """DCP's file-system reader with fz's JSON index and raw chunk reads: no unpickling."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = metadata_of(read_index(Path(self.path)))
        assert md.storage_meta is not None  # metadata_of makes one
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._tensors = metadata.state_dict_metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        sd = self._tensors
        for req in sorted(plan.items, key=lambda r: (self.storage_data[r.storage_index].relative_path,
                                                     self.storage_data[r.storage_index].offset)):
            if req.type == LoadItemType.BYTE_IO:
                raise CheckpointError(f"checkpoint {self.path}: {req.storage_index.fqn!r} is not a tensor")
            info = self.storage_data[req.storage_index]
            m = sd[req.storage_index.fqn]
            if not isinstance(m, TensorStorageMetadata):
                raise CheckpointError(f"checkpoint {self.path}: {req.storage_index.fqn!r} is not a tensor")
            chunk = next(c for c in m.chunks if c.offsets == req.storage_index.offset)
            tensor = read_chunk(inside(Path(self.path), Path(self.path) / info.relative_path), info.offset, info.length,
                                m.properties.dtype, tuple(chunk.sizes))
            for dim, (start, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                tensor = tensor.narrow(dim, start, n)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise CheckpointError(f"checkpoint {self.path}: {req.storage_index.fqn!r} chunk of size "
                                  f"{tuple(tensor.size())}, expected {tuple(target.size())}")
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut
