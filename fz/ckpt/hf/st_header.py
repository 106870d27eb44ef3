"""A safetensors file's header, validated as the safetensors crate validates it, before any value is read.

A weights folder may come from anyone, so its header is hostile input: every tensor's
`data_offsets` must be two integers, the tensors must tile the data section exactly (sorted by
offset, each starting where the last ended, the last ending at the file's end: no overlap, no
gap, no trailing bytes), each dtype must be known and its shape's bytes must fill its range, and
the header is bounded in size (safetensors' 100 MB) and in depth. Only regular files are opened,
and without blocking: a FIFO or a device named `model.safetensors` is refused, never read from.
Each refusal is a CheckpointError naming the file and the cause.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, TypeGuard

import torch

from fz.ckpt.regular import MAX_DIMS, open_regular
from fz.errors import CheckpointError

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
_FROM = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
Tensors = dict[str, tuple[torch.dtype, tuple[int, ...], int]]  # name: (dtype, shape, absolute byte offset)


def pread_exactly(fd: int, n: int, at: int) -> bytes:
    """`n` bytes at offset `at` (b'' short when the file ends first)."""
    parts, got = [], 0
    while got < n:
        chunk = os.pread(fd, n - got, at + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def read_json(path: Path, limit: int = MAX_HEADER, what: str = "file") -> Any:
    """A small JSON file (an index), refused when not regular, over `limit` bytes or too deep."""
    fd = open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointError(f"{what} {path} is {size} bytes, over the {limit >> 20} MiB fz reads")
        raw = pread_exactly(fd, size, 0)
    except OSError as e:
        raise CheckpointError(f"{what} {path} cannot be read ({e.strerror or e})") from e
    finally:
        os.close(fd)
    return _parse(raw, f"{what} {path}")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are distinct (json.loads would keep the last of a repeated name)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the key {k!r} appears twice")
        out[k] = v
    return out


def _parse(raw: bytes, where: str) -> Any:
    """JSON, its depth bounded by Python's recursion limit; `where` starts the message."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique)
    except RecursionError as e:
        raise CheckpointError(f"{where} nests deeper than Python's recursion limit (a safetensors header is 3 "
                              "levels deep): not read") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where} is not JSON ({e})") from e


def _ints(v: Any, n: int | None = None) -> TypeGuard[list[int]]:
    return (isinstance(v, list) and (n is None or len(v) == n)
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v))


MAX_NAME = 1024  # characters of a tensor name: a model's are a few dozen (every error names them)


def _entry(f: Path, name: str, info: Any) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, each field checked for its type; its name
    printable and bounded (it reaches error messages and warnings, and a terminal)."""
    if len(name) > MAX_NAME or not name.isprintable():
        raise CheckpointError(f"weights file {f}: a tensor name {name[:60]!r} ({len(name)} characters) that no model "
                              f"has: control characters, or over {MAX_NAME}: damaged or altered")
    where = f"weights file {f}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where} has a header entry that is not an object ({info!r:.80})")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _FROM:
        raise CheckpointError(f"{where} has dtype {dtype!r:.40}, not one fz reads ({', '.join(_FROM)})")
    if not _ints(shape):
        raise CheckpointError(f"{where} has shape {shape!r:.80}: must be a list of integers >= 0")
    if len(shape) > MAX_DIMS:
        raise CheckpointError(f"{where} has a shape of {len(shape)} dimensions, over {MAX_DIMS}: no model's "
                              "tensor has; damaged or altered")
    if not _ints(offsets, 2):
        raise CheckpointError(f"{where} has data_offsets {offsets!r:.80}: must be two integers >= 0 [begin, end]")
    return _FROM[dtype], tuple(shape), offsets[0], offsets[1]


def _tile(f: Path, found: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], data: int) -> None:
    """The tensors' byte ranges, sorted, must tile the `data` bytes after the header exactly, and
    each must hold its shape in its dtype (safetensors' `validate`)."""
    prev, before, at = "", 0, 0
    for name, (dtype, shape, lo, hi) in sorted(found.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if hi < lo:
            raise CheckpointError(f"weights file {f} is damaged: tensor {name!r} has data_offsets {lo}..{hi}, which "
                                  "end before they begin")
        if lo < at:
            raise CheckpointError(f"weights file {f} is damaged: tensors {prev!r} (bytes {before}..{at} of the data) "
                                  f"and {name!r} (bytes {lo}..{hi}) overlap")
        if lo > at:
            raise CheckpointError(f"weights file {f} is damaged: bytes {at}..{lo} of its data belong to no tensor "
                                  f"(before {name!r})")
        need = math.prod(shape) * dtype.itemsize
        if hi - lo != need:
            raise CheckpointError(f"weights file {f} is damaged: tensor {name!r} of shape {shape} {dtype} needs "
                                  f"{need} bytes, its data_offsets {lo}..{hi} hold {hi - lo}")
        prev, before, at = name, lo, hi
    if at > data:
        raise CheckpointError(f"weights file {f} is truncated: its header places tensors up to byte {at} of the "
                              f"data, which holds {data} bytes (an interrupted download or copy?)")
    if at < data:
        raise CheckpointError(f"weights file {f} is damaged: {data - at} bytes after its last tensor belong to no "
                              "tensor (safetensors refuses such a file)")


def header(f: Path) -> Tensors:
    """{name: (dtype, shape, absolute byte offset)} of the safetensors file `f`, its header validated."""
    fd = open_regular(f)
    try:
        size = os.fstat(fd).st_size
        raw = pread_exactly(fd, 8, 0)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if n > MAX_HEADER and n <= size - 8:
            raise CheckpointError(f"weights file {f} has a header of {n} bytes, over safetensors' limit of "
                                  f"{MAX_HEADER} bytes: not read")
        if not 0 < n <= size - 8:
            raise CheckpointError(f"weights file {f} is not a safetensors file (no valid header: a pickled "
                                  "checkpoint renamed, or a truncated file)")
        raw = pread_exactly(fd, n, 8)
    except OSError as e:
        raise CheckpointError(f"weights file {f} cannot be read ({e.strerror or e})") from e
    finally:
        os.close(fd)
    parsed = _parse(raw, f"weights file {f} is not a safetensors file: its header")
    if not isinstance(parsed, dict):
        raise CheckpointError(f"weights file {f} is not a safetensors file (its header is not a JSON object)")
    meta = parsed.pop("__metadata__", None)
    if meta is not None and (not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())):
        raise CheckpointError(f"weights file {f}: its __metadata__ is not a map of strings to strings "
                              f"({meta!r:.80})")
    found = {name: _entry(f, name, info) for name, info in parsed.items()}
    _tile(f, found, size - 8 - n)
    return {name: (dtype, shape, 8 + n + lo) for name, (dtype, shape, lo, _) in found.items()}
