"""Tensors of a DCP checkpoint in one process, without torch.distributed, through DCP's public
reader API: FileSystemReader and a LoadPlanner, driven the way dcp.load drives them.

DCP's reader torch.loads each stored chunk and copies it into the planner's target, so
`read` (a whole tensor into a fresh target) costs the tensor plus one chunk: twice the
tensor when one rank wrote it whole. `stream` meets "reading costs about the tensor"
instead: its targets are storage-less tensors whose copy_ hands each chunk to the caller
(who writes it out), so it costs one chunk. Nothing here parses DCP's file layout.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from fz.ckpt.index import SafeReader
from fz.errors import CheckpointError, ConfigError

Put = Callable[[tuple[int, ...], Tensor], None]


class _Sink(Tensor):
    """A tensor without storage: DCP's `target.copy_(chunk)` passes `chunk` to `put`."""

    _put: Callable[[Tensor], None]

    @staticmethod
    def __new__(cls, size: torch.Size, dtype: torch.dtype, put: Callable[[Tensor], None]):
        t = Tensor._make_wrapper_subclass(cls, size, dtype=dtype)
        t._put = put
        return t

    def __init__(self, size, dtype, put):
        super().__init__()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return args[0]
        if func is torch.ops.aten.copy_.default:
            args[0]._put(args[1])
            return args[0]
        raise RuntimeError(f"fz's streaming read got {func}; DCP's reader is expected to only copy_ into "
                                  "its targets (torch changed?)")


class _Streaming(DefaultLoadPlanner):
    """DCP's default planning, with each read's target a _Sink that forwards the chunk."""

    def __init__(self, put: Put):
        super().__init__()
        self._put_chunk = put

    def transform_tensor(self, read_item: ReadItem, tensor: Tensor) -> Tensor:
        offsets = tuple(read_item.dest_offsets)
        return _Sink(torch.Size(read_item.lengths), tensor.dtype, lambda chunk: self._put_chunk(offsets, chunk))


def read_metadata(directory: Path):
    """DCP's Metadata of a checkpoint directory, from fz's JSON index (never DCP's pickled
    .metadata); unreadable is a ConfigError naming the file."""
    return SafeReader(directory).read_metadata()


class CheckpointReader:
    """The tensors of one checkpoint directory, one at a time."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self._reader = SafeReader(self.dir)
        self._md = self._reader.read_metadata()  # fz's JSON index, read once
        self.meta = {k: m for k, m in self._md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
        self.chunks = 0

    def keys(self) -> list[str]:
        return list(self.meta)

    def read(self, key: str) -> Tensor:
        """The whole tensor (costs it plus one stored chunk)."""
        m = self.meta[key]
        out = torch.empty(tuple(m.size), dtype=m.properties.dtype)
        self._load(key, {key: out}, DefaultLoadPlanner())
        return out

    def stream(self, key: str, put: Put) -> None:
        """put(offsets, chunk) for each stored chunk of `key`, as DCP reads it; the chunks
        tile the tensor (`offsets` is where `chunk` starts)."""
        m = self.meta[key]
        sizes_only = torch.empty((), dtype=m.properties.dtype).expand(tuple(m.size))  # planning needs no storage

        def counted(offsets: tuple[int, ...], chunk: Tensor) -> None:
            self.chunks += 1
            put(offsets, chunk)

        self._load(key, {key: sizes_only}, _Streaming(counted))

    def _load(self, key: str, state_dict: dict[str, Tensor], planner: LoadPlanner) -> None:
        """The steps of dcp.load(no_dist=True), without reading the metadata again per call."""
        reader = self._reader
        try:
            reader.set_up_storage_reader(self._md, True)
            planner.set_up_planner(state_dict, self._md, True)
            plan = reader.prepare_local_plan(planner.create_local_plan())
            plan = reader.prepare_global_plan(planner.create_global_plan([plan]))[0]
            reader.read_data(planner.finish_plan(plan), planner).wait()
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - a damaged file, named in the error
            raise CheckpointError(f"cannot read {key} from {self.dir}: {type(e).__name__}: {e}") from e
