"""The zip a torch.save file is, as byte ranges: where its pickle and each storage's bytes lie.

torch.save writes an uncompressed zip whose members sit under one folder (the archive name):
`data.pkl` (the pickle) and `data/<key>` (each storage's raw bytes), with `byteorder` and a
few version records. Here the one `data.pkl` fixes the archive; a storage key resolves only
to a member of that archive, each member's bytes start where its local header says and must
end inside the file, and a name given twice is refused: so a tensor's bytes are always a
range of its own member of this file, whatever the pickle says.
"""
from __future__ import annotations

import os
import re
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from fz.ckpt.regular import open_regular_file
from fz.errors import CheckpointError

MAX_PICKLE = 256 << 20  # a record larger than this is not a checkpoint's metadata
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # a zip local file header (30 bytes)
_KEY = re.compile(r"^\w{1,64}$")  # torch's storage keys: "0", "1", ...


@dataclass(frozen=True)
class Archive:
    """One torch.save file: its pickle and {member below the archive folder: (first byte, size)}."""

    file: Path
    pickle: bytes
    members: dict[str, tuple[int, int]]

    def storage(self, key: object) -> tuple[int, int]:
        """(first byte, size) of storage `key`'s bytes: a member `data/<key>` of this archive."""
        if not isinstance(key, str) or not _KEY.match(key):
            raise CheckpointError(f"checkpoint file {self.file} names a storage {str(key)[:40]!r}, which is not a "
                                  "torch storage key: not read")
        if f"data/{key}" not in self.members:
            raise CheckpointError(f"checkpoint file {self.file}: storage data/{key} is not in its archive (a "
                                  "truncated or damaged file)")
        return self.members[f"data/{key}"]


def _members(file: Path, z: zipfile.ZipFile, fh: BinaryIO, size: int) -> dict[str, tuple[int, int]]:
    """{full member name: (absolute data offset, size)}, from the local headers, each inside the file."""
    out: dict[str, tuple[int, int]] = {}
    for info in z.infolist():
        if info.filename in out:
            raise CheckpointError(f"checkpoint file {file} holds member {info.filename} twice: not a torch checkpoint")
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"checkpoint file {file}: member {info.filename} is compressed, which "
                                  "torch.save never does: not a torch checkpoint")
        fh.seek(info.header_offset)
        raw = fh.read(_LOCAL_HEADER.size)
        head = _LOCAL_HEADER.unpack(raw) if len(raw) == _LOCAL_HEADER.size else None
        if head is None or head[0] != b"PK\x03\x04":
            raise CheckpointError(f"checkpoint file {file} is damaged (bad zip header for {info.filename})")
        at = info.header_offset + _LOCAL_HEADER.size + head[9] + head[10]
        if at + info.file_size > size:
            raise CheckpointError(f"checkpoint file {file}: member {info.filename} ends at byte "
                                  f"{at + info.file_size}, past the file's {size} (truncated or damaged)")
        out[info.filename] = (at, info.file_size)
    return out


def open_archive(file: Path) -> Archive:
    """The archive of the torch.save file `file` (a regular file), its pickle read."""
    with open_regular_file(file) as fh:
        size = os.fstat(fh.fileno()).st_size
        if fh.read(4) != b"PK\x03\x04":
            raise CheckpointError(f"checkpoint file {file} is not a torch.save zip file (the legacy "
                                  "pre-1.6 format or another file): fz reads only the zip format")
        every = _members(file, zipfile.ZipFile(fh), fh, size)
        pickles = [n for n in every if n == "data.pkl" or n.endswith("/data.pkl")]
        if len(pickles) != 1 or every[pickles[0]][1] > MAX_PICKLE:
            raise CheckpointError(f"checkpoint file {file} has {len(pickles)} data.pkl records"
                                  f"{' (or one too large)' if len(pickles) == 1 else ''}: not a torch.save file")
        prefix = pickles[0][:-len("data.pkl")]
        members = {n[len(prefix):]: r for n, r in every.items() if n.startswith(prefix)}
        at, n = members["data.pkl"]
        fh.seek(at)
        data = fh.read(n)
        order = members.get("byteorder")
        if order is not None:
            fh.seek(order[0])
            if fh.read(min(order[1], 16)) != b"little":
                raise CheckpointError(f"checkpoint file {file} was written big-endian: not supported")
    return Archive(file, data, members)
