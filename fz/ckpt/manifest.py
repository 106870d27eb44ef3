"""The manifest: size and checksum of every file of a checkpoint, written last, checked first.

xxh3-64 (xxhash) rather than sha256: a checksum here guards against truncation and bit rot,
not tampering, and xxh3 runs at ~29 GB/s on this machine against zlib's crc32 at ~7 and sha256
at 1.4. Checkpoints written before issue 26 list crc32s; they are read and checked as such.
The saver hashes each data file as it writes it (fz/ckpt/writer.py), so this module reads a
file only to verify it. The manifest carries its own crc over the file table, so a damaged
manifest is detected as such. Saved with a key, each file's checksum is a sha256 and the table
is signed (fz/ckpt/signing.py). Every name it lists must be a regular file of the folder itself
(no '/', no '..', no symlink out of it): checked with a stat before any file is opened.
"""
from __future__ import annotations

import hashlib
import json
import re
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import xxhash

from fz.ckpt import signing
from fz.ckpt.layout import MANIFEST, write_durable
from fz.ckpt.regular import inside, open_regular_file, parse_json, plain_name, read_regular, stat_regular
from fz.errors import CheckpointError

ALGORITHM = "xxh3"
ALGORITHMS = ("xxh3", "crc32", "sha256")  # what a manifest may list (crc32: checkpoints before issue 26)
_HEX = re.compile(r"[0-9a-f]{1,128}")  # a digest as hexdigest() writes it
_BLOCK = 4 << 20


class _Crc32:
    """zlib's crc32 with hashlib's update/hexdigest."""

    def __init__(self) -> None:
        self.crc = 0

    def update(self, data: Any) -> None:
        self.crc = zlib.crc32(data, self.crc)

    def hexdigest(self) -> str:
        return f"{self.crc:08x}"


def hasher(algorithm: str) -> Any:
    """A fresh hash object (update, hexdigest) for one of ALGORITHMS."""
    if algorithm == "xxh3":
        return xxhash.xxh3_64()
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "crc32":
        return _Crc32()
    raise ValueError(f"unknown checksum algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")


def file_checksum(path: Path, algorithm: str | None = None, progress: Callable[[int], None] | None = None) -> str:
    """Hex checksum of a file, read in 4 MiB blocks (bounded memory); a FIFO or a device is
    refused, never read from."""
    h = hasher(algorithm or ALGORITHM)
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    with open_regular_file(path) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            if progress is not None:
                progress(n)
    return h.hexdigest()


def describe(directory: Path, names: Iterable[str], algorithm: str | None = None) -> dict[str, dict]:
    """{name: {"size", "checksum", "algorithm"}} for files of `directory` (crc32 unless `algorithm`)."""
    alg = algorithm or ALGORITHM
    return {n: {"size": stat_regular(directory / n).st_size, "checksum": file_checksum(directory / n, alg),
                "algorithm": alg} for n in names}


def _table_crc(files: dict[str, dict]) -> str:
    return f"{zlib.crc32(json.dumps(files, sort_keys=True).encode()):08x}"


def write(directory: Path, files: dict[str, dict], key: bytes | None = None) -> None:
    """The manifest, signed when a `key` is given (its files' checksums must then be sha256)."""
    body = {"files": files, "table_crc": _table_crc(files)}
    if key is not None:
        body["hmac"] = signing.sign(key, files)
    write_durable(directory / MANIFEST, json.dumps(body, indent=1, sort_keys=True).encode())


def _body(directory: Path) -> tuple[dict, dict[str, dict]]:
    p = directory / MANIFEST
    try:
        raw = read_regular(inside(directory, p, "the manifest"), "the manifest")
    except FileNotFoundError:
        raise CheckpointError(f"{p} is missing: {directory} is not a complete fz checkpoint") from None
    try:
        body = parse_json(raw, f"the manifest {p}")
        files = body["files"]
        if not isinstance(files, dict):
            raise TypeError(f"its files are a {type(files).__name__}, not an object")
        ok = body["table_crc"] == _table_crc(files)
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{p} is unreadable ({type(e).__name__}: {e}): the manifest is damaged") from None
    if not ok:
        raise CheckpointError(f"{p} is damaged: its own checksum does not match its contents")
    for name, entry in files.items():
        if not isinstance(entry, dict) or entry.get("algorithm") not in ALGORITHMS:
            raise CheckpointError(f"{p} lists {name!r:.100} as {entry!r:.80}: not an object with a checksum algorithm "
                                  f"fz knows ({', '.join(ALGORITHMS)}); the manifest is damaged or altered")
        size, checksum = entry.get("size"), entry.get("checksum")
        if type(size) is not int or size < 0 or not isinstance(checksum, str) or not _HEX.fullmatch(checksum):
            raise CheckpointError(f"{p} lists {name!r:.100} with size {size!r:.40} and checksum {checksum!r:.40}: "
                                  "not a size in bytes and a checksum (hex digits); the manifest is damaged or altered")
    bad = next((n for n in files if not plain_name(n)), None)
    if bad is not None:
        raise CheckpointError(f"{p} lists {bad!r:.100}, which is not a file name of {directory} (a path, '..' or "
                              "empty): not read")
    return body, files


def read(directory: Path, key: bytes | None = None) -> dict[str, dict]:
    """The file table; a missing or damaged manifest is a CheckpointError, and so is, given a
    `key`, one that this key did not sign."""
    body, files = _body(directory)
    if key is not None:
        signing.check(str(directory / MANIFEST), body, files, key)
    return files


def is_signed(directory: Path) -> bool:
    """Whether the manifest carries a signature (checked only against a key: `read`)."""
    return isinstance(_body(directory)[0].get("hmac"), str)


def check_sizes(directory: Path, files: dict[str, dict]) -> None:
    """Every listed file exists inside `directory` as a regular file of its recorded size (cheap:
    one stat each; nothing is opened)."""
    for name, info in sorted(files.items()):
        p = inside(directory, directory / name)
        try:
            size = stat_regular(p).st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {p} is missing (listed in {MANIFEST})") from None
        if size != info["size"]:
            what = "truncated" if size < info["size"] else "longer than written"
            raise CheckpointError(f"checkpoint file {p} is {what}: {size} bytes, the manifest says {info['size']}")


def check_sums(directory: Path, files: dict[str, dict], names: list[str],
               progress: Callable[[int], None] | None = None) -> None:
    """The checksums of `names` (a subset of the manifest) match."""
    for name in names:
        info = files[name]
        got = file_checksum(directory / name, info["algorithm"], progress)
        if got != info["checksum"]:
            raise CheckpointError(f"checkpoint file {directory / name} is corrupted: {info['algorithm']} {got}, "
                              f"the manifest says {info['checksum']}")


def verify(directory: Path, progress: Callable[[int], None] | None = None,
           key: bytes | None = None) -> dict[str, dict]:
    """Full single-process verification (inspect, consolidate): the signature given a `key`,
    sizes, then every checksum."""
    files = read(directory, key)
    check_sizes(directory, files)
    check_sums(directory, files, sorted(files), progress)
    return files
