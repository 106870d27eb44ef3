"""Read a `torch.save` file (DeepSpeed's checkpoint files) without running any of its code.

`torch.load` executes the pickle: any callable a file names is called. Here `pickle.Unpickler`
resolves names only through a fixed table (`_ALLOWED`): torch's tensor rebuild functions are
replaced by ours, which return a `Lazy` reference (where the bytes are, dtype, offset, size,
stride) instead of reading the data; DeepSpeed's own classes that appear in its checkpoints
become plain data (an int, a dict of their state). Any other name, or a persistent id other
than torch's ('storage', ...), is a CheckpointError naming it and the file: nothing is called.

torch stores every storage as an uncompressed zip member, so a tensor's bytes are a byte range
of the file (found from the member's local header) and are read with `os.pread` in chunks of
at most `CHUNK_BYTES`: a large tensor never has to be in memory whole.
"""
from __future__ import annotations

import collections
import math
import os
import pickle
import struct
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fz.ckpt.weights import CHUNK_BYTES, read_range
from fz.errors import CheckpointError

_MAX_PICKLE = 256 << 20  # a record larger than this is not a checkpoint's metadata
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # a zip local file header (30 bytes)


@dataclass(frozen=True)
class Lazy:
    """A tensor of a torch.save file, not read: its storage's bytes start at `at` in `file`."""

    file: Path
    at: int  # absolute byte offset of the storage's first element
    dtype: torch.dtype
    storage_numel: int
    offset: int  # storage offset, in elements
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def contiguous(self) -> bool:
        want, n = [], 1
        for s in reversed(self.shape):
            want.append(n)
            n *= s
        return self.numel == 0 or all(a == b for a, b, s in zip(self.stride, reversed(want), self.shape) if s > 1)


@dataclass(frozen=True)
class DSObject:
    """An instance of one of DeepSpeed's allowed classes, as plain data: its class name and state."""

    cls: str
    state: dict[str, Any]


class _Storage:
    """A storage named by a persistent id: where its bytes are, not the bytes."""

    def __init__(self, file: Path, at: int, dtype: torch.dtype, numel: int):
        self.file, self.at, self.dtype, self.numel = file, at, dtype, numel


class _Sealed:
    """The table's objects are shared by every load: a BUILD opcode must not change them."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError(f"a BUILD of {type(self).__name__}, which takes no state")

    def __setattr__(self, name: str, value: Any) -> None:
        raise pickle.UnpicklingError(f"an attribute set on {type(self).__name__}")


class _StorageType(_Sealed):
    """What `torch.FloatStorage` & co. resolve to: only their dtype is used."""

    __slots__ = ("dtype",)
    dtype: torch.dtype | None

    def __init__(self, dtype: torch.dtype | None):
        object.__setattr__(self, "dtype", dtype)


class _Call(_Sealed):
    """One of the table's functions, sealed."""

    __slots__ = ("fn",)
    fn: Any

    def __init__(self, fn: Any):
        object.__setattr__(self, "fn", fn)

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


_STORAGES = {"DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
             "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
             "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
             "BoolStorage": torch.bool}
_DTYPES = {"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}


def _rebuild_tensor_v2(storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...],
                       *_: Any) -> Lazy:
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("_rebuild_tensor_v2 of something that is not a storage")
    shape: tuple[int, ...] = tuple(int(s) for s in size)
    steps: tuple[int, ...] = tuple(int(s) for s in stride)
    numel = math.prod(shape)
    last = offset + sum((s - 1) * st for s, st in zip(shape, steps))
    if offset < 0 or any(st < 0 for st in steps) or (numel and last >= storage.numel):
        raise pickle.UnpicklingError(f"a tensor of size {shape} at offset {offset} is past its storage "
                                     f"({storage.numel} elements)")
    return Lazy(storage.file, storage.at, storage.dtype, storage.numel, int(offset), shape, steps)


def _rebuild_parameter(data: Lazy, *_: Any) -> Lazy:
    return data


def _rebuild_from_type_v2(func: Any, new_type: Any, args: tuple, state: Any) -> Lazy:
    """A tensor with attributes (ZeRO-3 sets `ds_id` on its flat groups): the attributes are dropped."""
    if func is not _ALLOWED["torch._utils._rebuild_tensor_v2"] or new_type is not _TENSOR \
            or not isinstance(state, dict | None):
        raise pickle.UnpicklingError("_rebuild_from_type_v2 of something other than a plain tensor")
    return _rebuild_tensor_v2(*args)


_TENSOR = _Sealed()  # what `torch.Tensor` resolves to: only _rebuild_from_type_v2 accepts it


class _Plain:
    """DeepSpeed's classes: built by NEWOBJ/BUILD into a dict of their state, never run."""

    cls = ""

    def __setstate__(self, state: Any) -> None:
        self.__dict__["_state"] = dict(state) if isinstance(state, dict) else {"state": state}


def _plain(name: str) -> type[_Plain]:
    return type("DS_" + name.rsplit(".", 1)[-1], (_Plain,), {"cls": name})


def _zero_stage(value: int) -> int:
    return int(value)


# module.name -> what it resolves to: the only names a file may use
_ALLOWED: dict[str, Any] = {
    "torch._utils._rebuild_tensor_v2": _Call(_rebuild_tensor_v2),
    "torch._utils._rebuild_parameter": _Call(_rebuild_parameter),
    "torch._tensor._rebuild_from_type_v2": _Call(_rebuild_from_type_v2),
    "torch.Tensor": _TENSOR,
    "torch.Size": _Call(tuple),
    "torch.device": _Call(str),
    "torch.storage.UntypedStorage": _StorageType(None),
    "collections.OrderedDict": _Call(collections.OrderedDict),
    "deepspeed.runtime.zero.config.ZeroStageEnum": _Call(_zero_stage),
    **{f"torch.{k}": _StorageType(v) for k, v in _STORAGES.items()},
    **{f"torch.{d}": getattr(torch, d) for d in _DTYPES},
    **{f"deepspeed.{c}": _plain(f"deepspeed.{c}") for c in (
        "utils.tensor_fragment.fragment_address", "runtime.fp16.loss_scaler.LossScaler",
        "runtime.fp16.loss_scaler.DynamicLossScaler")},
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: Any, file: Path, members: dict[str, tuple[int, int]]):
        super().__init__(data)
        self.file, self.members = file, members

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full not in _ALLOWED:
            raise CheckpointError(f"checkpoint file {self.file} names {full}, which fz does not load: "
                                  "not read (unpickling it could run code)")
        return _ALLOWED[full]

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise CheckpointError(f"checkpoint file {self.file} has a persistent id {str(pid)[:80]!r} that is "
                                  "not a torch storage: not read")
        _, kind, key, _, numel = pid
        dtype = kind.dtype
        if dtype is None:  # an UntypedStorage is bytes
            dtype = torch.uint8
        at, size = self.members.get(f"data/{key}", (-1, -1))
        if at < 0 or size < int(numel) * dtype.itemsize:
            raise CheckpointError(f"checkpoint file {self.file}: storage data/{key} is missing or shorter than "
                                  f"{numel} x {dtype} (a truncated or damaged file)")
        return _Storage(self.file, at, dtype, int(numel))


def _members(file: Path, z: zipfile.ZipFile, fh: Any) -> dict[str, tuple[int, int]]:
    """{member name without the archive folder: (absolute data offset, size)}, from the local headers."""
    out = {}
    for info in z.infolist():
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"checkpoint file {file}: member {info.filename} is compressed, which "
                                  "torch.save never does: not a torch checkpoint")
        fh.seek(info.header_offset)
        head = _LOCAL_HEADER.unpack(fh.read(_LOCAL_HEADER.size))
        if head[0] != b"PK\x03\x04":
            raise CheckpointError(f"checkpoint file {file} is damaged (bad zip header for {info.filename})")
        out[info.filename.split("/", 1)[-1]] = (info.header_offset + _LOCAL_HEADER.size + head[9] + head[10],
                                                info.file_size)
    return out


def _plainify(x: Any) -> Any:
    if isinstance(x, _Plain):
        return DSObject(type(x).cls, {k: _plainify(v) for k, v in x.__dict__.get("_state", {}).items()})
    if isinstance(x, dict):
        return type(x)((k, _plainify(v)) for k, v in x.items())
    if isinstance(x, list):
        return [_plainify(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_plainify(v) for v in x)
    return x


def load(path: str | os.PathLike[str]) -> Any:
    """The object a torch.save zip file holds, with tensors as `Lazy` and DeepSpeed's objects as
    `DSObject`; a file naming anything outside the table is refused unread."""
    file = Path(path)
    try:
        with open(file, "rb") as fh:
            if fh.read(4) != b"PK\x03\x04":
                raise CheckpointError(f"checkpoint file {file} is not a torch.save zip file (the legacy "
                                      "pre-1.6 format or another file): fz reads only the zip format")
            z = zipfile.ZipFile(fh)
            members = _members(file, z, fh)
            pkl = members.get("data.pkl")
            if pkl is None or pkl[1] > _MAX_PICKLE:
                raise CheckpointError(f"checkpoint file {file} has no data.pkl record (not a torch.save file)")
            fh.seek(pkl[0])
            data = fh.read(pkl[1])
            order = members.get("byteorder")
            if order is not None:
                fh.seek(order[0])
                if fh.read(order[1]) != b"little":
                    raise CheckpointError(f"checkpoint file {file} was written big-endian: not supported")
        import io
        return _plainify(_Unpickler(io.BytesIO(data), file, members).load())
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(f"checkpoint file {file} cannot be read ({e.strerror or e})") from e
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, ValueError, TypeError, IndexError,
            KeyError, AttributeError, struct.error) as e:
        raise CheckpointError(f"checkpoint file {file} is damaged or not a checkpoint fz reads "
                              f"({type(e).__name__}: {e})") from e


def read(t: Lazy, lo: int = 0, hi: int | None = None,
         chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, Tensor]]:
    """Elements [lo, hi) of the flattened contiguous tensor `t`, as (first element, 1-D chunk)
    pieces of at most `chunk_bytes`, each read with os.pread."""
    hi = t.numel if hi is None else hi
    if not t.contiguous():
        flat = materialize(t).reshape(-1)
        for at in range(lo, hi, max(1, chunk_bytes // t.dtype.itemsize)):
            yield at, flat[at:min(hi, at + chunk_bytes // t.dtype.itemsize)].clone()
        return
    if not 0 <= lo <= hi <= t.numel:
        raise CheckpointError(f"checkpoint file {t.file}: elements [{lo}, {hi}) asked of a tensor of {t.numel}")
    yield from read_range(t.file, t.at + t.offset * t.dtype.itemsize, t.dtype, lo, hi, chunk_bytes,
                          "checkpoint file")


def materialize(t: Lazy) -> Tensor:
    """The whole tensor `t` (for small ones: buffers, a step count, a frozen fragment)."""
    if t.contiguous():
        out = torch.empty(t.numel, dtype=t.dtype)
        for at, chunk in read(t):
            out[at:at + chunk.numel()] = chunk
        return out.view(t.shape)
    span = t.offset + sum((s - 1) * st for s, st in zip(t.shape, t.stride)) + 1
    whole = materialize(Lazy(t.file, t.at, t.dtype, t.storage_numel, 0, (span,), (1,)))
    return whole.as_strided(t.shape, t.stride, t.offset).clone()
