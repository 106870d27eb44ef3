"""One stored chunk of a DCP data file, read without unpickling.

DCP writes each chunk with `torch.save`: a zip holding `data.pkl` (how to rebuild the tensor)
and `data/<key>` (its raw storage). `torch.load` would run that pickle; here its opcodes are
only parsed (`pickletools.genops` never executes them), checked to be the one call torch.save
writes for a tensor (`_rebuild_tensor_v2(storage, offset, size, stride, ...)`), and the raw
bytes are read straight into the tensor. Anything else in the file is an error naming it. Every
size and offset the zip's directory states is checked against the chunk's bytes (which lie inside
the file) before anything is allocated from it, and only a regular file is opened (no FIFO).
"""
from __future__ import annotations

import pickletools
import struct
import zipfile
from io import BufferedReader
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fz.ckpt.regular import open_regular_file
from fz.errors import CheckpointError, ConfigError

_PUSH_ARG = {"SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BININT", "BININT1", "BININT2", "LONG1", "SHORT_BINSTRING",
             "BINSTRING"}
_CONST = {"NEWTRUE": True, "NEWFALSE": False, "NONE": None}
_MAX_PICKLE = 1 << 16  # a tensor record's pickle is ~150 bytes


class _Slice:
    """A read-only file object over [start, start + length) of a file, for zipfile."""

    def __init__(self, f: BufferedReader, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n is None or n < 0 else min(n, self.length - self.pos)
        self.f.seek(self.start + self.pos)
        out = self.f.read(max(n, 0))
        self.pos += len(out)
        return out

    def seekable(self) -> bool:
        return True


def _parse(data: bytes) -> Any:
    """The value a torch.save pickle builds, as inert tuples: ('global', module, name),
    ('pid', tuple), ('call', func, args). Opcodes beyond plain data and one call are refused."""
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[Any, Any] = {}  # memo index -> value
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name in ("PROTO", "FRAME"):
            continue
        if name in _PUSH_ARG:
            stack.append(arg)
        elif name in _CONST:
            stack.append(_CONST[name])
        elif name == "GLOBAL":
            assert isinstance(arg, str)  # pickletools gives GLOBAL "module name"
            module, _, attr = arg.partition(" ")
            stack.append(("global", module, attr))
        elif name == "MARK":
            marks.append(len(stack))
        elif name == "TUPLE":
            at = marks.pop()
            stack[at:] = [tuple(stack[at:])]
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            stack[-n:] = [tuple(stack[-n:])]
        elif name == "EMPTY_TUPLE":
            stack.append(())
        elif name in ("BINPUT", "LONG_BINPUT", "MEMOIZE"):
            memo[arg if arg is not None else len(memo)] = stack[-1]
        elif name in ("BINGET", "LONG_BINGET"):
            stack.append(memo[arg])
        elif name == "BINPERSID":
            stack.append(("pid", stack.pop()))
        elif name == "REDUCE":
            args, func = stack.pop(), stack.pop()
            stack.append(("call", func, args))
        elif name == "STOP":
            return stack.pop()
        else:
            raise ValueError(f"opcode {name} is not part of a tensor record")
    raise ValueError("no STOP opcode")


def _contiguous(sizes: tuple[int, ...]) -> tuple[int, ...]:
    out, n = [], 1
    for s in reversed(sizes):
        out.append(n)
        n *= max(s, 1)
    return tuple(reversed(out))


def read_chunk(path: Path, at: int, length: int, dtype: torch.dtype, sizes: tuple[int, ...]) -> Tensor:
    """The chunk of `sizes` and `dtype` stored at [at, at + length) of `path`."""
    try:
        with open_regular_file(path) as f:
            f.seek(0, 2)
            if at + length > f.tell():
                raise ValueError(f"the chunk at bytes {at}-{at + length} is past the file's end ({f.tell()} bytes)")
            return _read(f, at, length, dtype, tuple(sizes))
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError, IndexError, TypeError, zipfile.BadZipFile, struct.error) as e:
        raise CheckpointError(f"checkpoint file {path} is unreadable: damaged, or not what fz wrote "
                          f"({type(e).__name__}: {e})") from e


def _read(f: BufferedReader, at: int, length: int, dtype: torch.dtype, sizes: tuple[int, ...]) -> Tensor:
    z = zipfile.ZipFile(_Slice(f, at, length))
    names = {i.filename.split("/", 1)[-1]: i for i in z.infolist()}
    pkl = names.get("data.pkl")
    if pkl is None or pkl.file_size > _MAX_PICKLE:
        raise ValueError("no tensor record (data.pkl) in the chunk")
    order = names.get("byteorder")
    if order is not None and (order.file_size > 16 or z.read(order) != b"little"):
        raise ValueError("a big-endian record")
    value = _parse(z.read(pkl))
    if not (isinstance(value, tuple) and value[:2] == ("call", ("global", "torch._utils", "_rebuild_tensor_v2"))):
        raise ValueError("the record does not rebuild a tensor")
    args = value[2]
    pid = args[0]
    if not (pid[0] == "pid" and pid[1][0] == "storage" and pid[1][3] == "cpu"):
        raise ValueError("the record's storage is not a cpu storage")
    key, numel = str(pid[1][2]), pid[1][4]
    offset, size, stride = args[1], tuple(args[2]), tuple(args[3])
    if size != sizes:
        raise ValueError(f"the record holds a tensor of size {list(size)}, the index says {list(sizes)}")
    entry = names.get(f"data/{key}")
    item = torch.empty((), dtype=dtype).element_size()
    if entry is None or entry.compress_type != zipfile.ZIP_STORED or entry.file_size != numel * item:
        raise ValueError(f"the record's storage data/{key} is missing, compressed or not {numel} x {dtype}")
    if not isinstance(offset, int) or offset < 0 or any(not isinstance(st, int) or st < 0 for st in stride) \
            or len(stride) != len(size):
        raise ValueError(f"the record's offset {offset!r} or stride {stride!r} is not a tensor's")
    if 0 not in size and offset + sum((s - 1) * st for s, st in zip(size, stride)) >= numel:
        raise ValueError("the record's size and stride reach beyond its storage")
    if _numel(size) > numel:  # a stride of 0 (or an overlap) repeating the stored elements: bounded by the file
        raise ValueError(f"the record's size {list(size)} holds more elements than its storage's {numel}")
    if 0 in size:
        return torch.empty(size, dtype=dtype)
    if entry.header_offset + 30 > length:
        raise ValueError(f"the record's storage data/{key} starts past the chunk's {length} bytes")
    f.seek(at + entry.header_offset)
    head = f.read(30)
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    start = entry.header_offset + 30 + name_len + extra_len
    if entry.compress_size != entry.file_size or start + entry.file_size > length:
        raise ValueError(f"the record's storage data/{key} claims {entry.file_size} bytes at byte {start}, past the "
                         f"chunk's {length} bytes")
    f.seek(at + start)
    buf = bytearray(entry.file_size)
    if f.readinto(buf) != len(buf):
        raise ValueError("the record's storage is truncated")
    storage = torch.frombuffer(buf, dtype=dtype)
    if stride == _contiguous(size) and offset == 0:
        return storage[:_numel(size)].view(size)
    return storage.as_strided(size, stride, offset)


def _numel(size: tuple[int, ...]) -> int:
    n = 1
    for s in size:
        n *= s
    return n
