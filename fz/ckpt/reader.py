"""Read whole tensors out of a DCP checkpoint in one process, without torch.distributed.

DCP's own reader `torch.load`s each saved chunk and then copies it into the target: two
copies of a replicated tensor in memory. This reader copies each chunk's bytes straight
from the file into its region of the output (DCP writes a chunk as a torch.save archive
whose storage record is stored uncompressed), so reading a tensor costs the tensor itself.
Anything else (stream transforms, strided chunks) falls back to torch.load of that chunk.
"""
from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path
from typing import Dict, List, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor

from fz.errors import ConfigError


class _Slice(io.RawIOBase):
    """A read-only, seekable view of bytes [start, start + length) of an open file."""

    def __init__(self, f, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, off: int, whence: int = 0) -> int:
        self.pos = {0: off, 1: self.pos + off, 2: self.length + off}[whence]
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(b)[:n]) if n else 0
        self.pos += got
        return got


def _bytes_view(t: Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class CheckpointReader:
    """Whole tensors of one checkpoint directory, read chunk by chunk."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        md = dcp.FileSystemReader(self.dir).read_metadata()
        self.meta = {k: m for k, m in md.state_dict_metadata.items() if hasattr(m, "size")}
        self.items: Dict[str, List[Tuple[torch.Size, object]]] = {}
        for idx, info in md.storage_data.items():
            self.items.setdefault(idx.fqn, []).append((idx.offset, info))
        self.fast_chunks = self.slow_chunks = 0

    def keys(self) -> List[str]:
        return list(self.meta)

    def read(self, key: str) -> Tensor:
        m = self.meta[key]
        out = torch.empty(tuple(m.size), dtype=m.properties.dtype)
        sizes = {tuple(c.offsets): tuple(c.sizes) for c in m.chunks}
        for offset, info in self.items.get(key, []):
            size = sizes[tuple(offset)]
            region = out
            for dim, (o, s) in enumerate(zip(offset, size)):
                region = region.narrow(dim, o, s)
            self._read_chunk(info, region, key)
        return out

    def _read_chunk(self, info, region: Tensor, key: str) -> None:
        path = self.dir / info.relative_path
        with open(path, "rb", buffering=0) as f:
            sl = _Slice(f, info.offset, info.length)
            if not info.transform_descriptors and region.is_contiguous() and self._fast(sl, region):
                self.fast_chunks += 1
                return
            sl.seek(0)
            try:
                chunk = torch.load(io.BufferedReader(sl), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - a damaged file, named in the error
                raise ConfigError(f"cannot read {key} from {path}: {type(e).__name__}: {e}") from e
            region.copy_(chunk.view(region.shape))
            self.slow_chunks += 1

    @staticmethod
    def _fast(sl: _Slice, region: Tensor) -> bool:
        """Copy the archive's raw storage record into `region` if its layout is plain."""
        try:
            zf = zipfile.ZipFile(io.BufferedReader(sl))
            records = [i for i in zf.infolist() if "/data/" in i.filename and not i.filename.endswith("/")]
            if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED:
                return False
            rec = records[0]
            if rec.file_size != region.numel() * region.element_size():
                return False
            sl.seek(0)
            with torch.serialization.skip_data():
                probe = torch.load(io.BufferedReader(sl), weights_only=True)
            if probe.storage_offset() != 0 or not probe.is_contiguous() or probe.shape != region.shape:
                return False
            sl.seek(rec.header_offset)
            head = sl.read(30)
            name_len, extra_len = struct.unpack("<HH", head[26:30])
            sl.seek(rec.header_offset + 30 + name_len + extra_len)
        except Exception:  # noqa: BLE001 - not the layout we know: use torch.load
            return False
        view = _bytes_view(region)
        got = 0
        while got < len(view):
            n = sl.readinto(view[got:])
            if not n:
                return False
            got += n
        return True
