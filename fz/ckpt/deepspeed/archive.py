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
MAX_MEMBERS = 1 << 18  # torch.save writes one member per storage and a few records: more is no checkpoint
_END = struct.Struct("<4s4H2LH")  # the end of central directory record (22 bytes, then a comment)
_END64_LOCATOR = struct.Struct("<4sLQL")  # zip64: where its end record is (20 bytes, just before the end record)
_END64 = struct.Struct("<4sQ2H2L4Q")  # zip64's end of central directory record


def _entries(file: Path, fh: BinaryIO, size: int) -> int:
    """At least as many as the members zipfile would build an object for: the entry signatures in
    the central directory where zipfile reads it, the directory's size before its end record
    (whatever offset the record states; a directory of millions of entries costs minutes and GBs
    to parse, counting its signatures a pass over its bytes)."""
    tail = min(size, _END.size + 0xFFFF)
    fh.seek(size - tail)
    raw = fh.read(tail)
    at = raw.rfind(b"PK\x05\x06")
    if at < 0 or at + _END.size > len(raw):
        raise CheckpointError(f"checkpoint file {file} has no zip end record: truncated, or not a torch.save file")
    length = _END.unpack_from(raw, at)[5]
    end = size - tail + at  # the end record's place in the file: zipfile reads the directory just before it
    if at >= _END64_LOCATOR.size:  # zip64 (a file past 4 GiB): the directory's size is in its own end record
        sig = _END64_LOCATOR.unpack_from(raw, at - _END64_LOCATOR.size)[0]
        if sig == b"PK\x06\x07":
            end64_at = end - _END64_LOCATOR.size - _END64.size  # where zipfile looks for it
            fh.seek(max(end64_at, 0))
            end64 = fh.read(_END64.size)
            if end64_at >= 0 and len(end64) == _END64.size and end64[:4] == b"PK\x06\x06":
                length, end = _END64.unpack(end64)[8], end64_at
    if length > end:
        raise CheckpointError(f"checkpoint file {file}: its zip directory starts before the file (truncated or "
                              "damaged)")
    fh.seek(end - length)
    return fh.read(length).count(b"PK\x01\x02")


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
        entries = _entries(file, fh, size)
        if entries > MAX_MEMBERS:
            raise CheckpointError(f"checkpoint file {file}: its zip directory holds {entries} entries, more than "
                                  f"{MAX_MEMBERS} (torch.save writes one per tensor storage): not a torch checkpoint")
        fh.seek(0)
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
