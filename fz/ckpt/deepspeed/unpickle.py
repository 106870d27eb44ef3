"""Read a `torch.save` file (DeepSpeed's checkpoint files) without running any of its code.

`torch.load` executes the pickle: any callable a file names is called. Here the pickle's
opcodes are interpreted by ds_opcodes (nothing is looked up on an object, nothing runs) and
each global resolves only through a fixed table (`_ALLOWED`): torch's tensor rebuild
functions become ours, which return a `Lazy` reference (where the bytes are, dtype, offset,
size, stride) instead of reading the data; DeepSpeed's own classes that appear in its
checkpoints become plain data (an int, a `DSObject` of their state). Any other name, or a
persistent id other than torch's ('storage', ...), is a CheckpointError naming it and the
file: nothing is called. It is stricter than `torch.load(weights_only=True)`: a storage
resolves only to its member of the same archive (ds_archive) and no later opcode can change
a storage or tensor; a tensor's size and stride must stay inside its storage's elements (a
stride of 0 that repeats one element 2**31 times is refused, not allocated); the value is
bounded by the file's size (ds_opcodes.bound).

torch stores every storage as an uncompressed zip member, so a tensor's bytes are a byte range
of the file and are read with `os.pread` in chunks of at most `CHUNK_BYTES`: a large tensor
never has to be in memory whole.
"""
from __future__ import annotations

import collections
import math
import os
import struct
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fz.ckpt.deepspeed import opcodes as ds_opcodes
from fz.ckpt.deepspeed.archive import Archive, open_archive
from fz.ckpt.deepspeed.opcodes import Call, Class, DSObject, Refused
from fz.ckpt.hf.weights import CHUNK_BYTES, read_range
from fz.errors import CheckpointError

__all__ = ["DSObject", "Lazy", "load", "materialize", "read"]
_MAX_DIMS = 64  # torch's own limit on a tensor's dimensions


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
class _Storage:
    """A storage named by a persistent id: where its bytes are, not the bytes."""

    file: Path
    at: int
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class _StorageType:
    """What `torch.FloatStorage` & co. resolve to: only their dtype is used."""

    dtype: torch.dtype | None


class _Marker:
    """What `torch.Tensor` resolves to: only _rebuild_from_type_v2 accepts it."""


_STORAGES = {"DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
             "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
             "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
             "BoolStorage": torch.bool}
_DTYPES = {"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}


def _ints(what: str, xs: Any) -> tuple[int, ...]:
    if not isinstance(xs, tuple | list) or len(xs) > _MAX_DIMS or any(type(x) is not int or x < 0 for x in xs):
        raise Refused(f"a tensor {what} {str(xs)[:80]} that is not up to {_MAX_DIMS} non-negative ints")
    return tuple(xs)


def _rebuild_tensor_v2(storage: _Storage, offset: int, size: Any, stride: Any, *_: Any) -> Lazy:
    """A tensor as a reference into its storage, its elements checked to lie inside the storage:
    no negative size, stride or offset, and at most as many elements as the storage holds."""
    if not isinstance(storage, _Storage):
        raise Refused("_rebuild_tensor_v2 of something that is not a storage")
    shape, steps = _ints("size", size), _ints("stride", stride)
    if type(offset) is not int or offset < 0 or len(shape) != len(steps):
        raise Refused(f"a tensor of size {shape}, stride {steps} at offset {offset!r}: not a tensor's")
    numel = math.prod(shape)
    last = offset + sum((s - 1) * st for s, st in zip(shape, steps)) if numel else offset - 1
    if numel > storage.numel or last >= storage.numel:
        raise Refused(f"a tensor of size {shape}, stride {steps} at offset {offset} needs more than its storage's "
                      f"{storage.numel} elements (a stride of 0 or an overlap repeating them, or past its end)")
    return Lazy(storage.file, storage.at, storage.dtype, storage.numel, offset, shape, steps)


def _rebuild_parameter(data: Lazy, *_: Any) -> Lazy:
    if not isinstance(data, Lazy):
        raise Refused("_rebuild_parameter of something that is not a tensor")
    return data


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Lazy:
    """A tensor with attributes (ZeRO-3 sets `ds_id` on its flat groups): the attributes are dropped."""
    if func is not _ALLOWED["torch._utils._rebuild_tensor_v2"] or new_type is not _TENSOR \
            or not isinstance(args, tuple) or not isinstance(state, dict | None):
        raise Refused("_rebuild_from_type_v2 of something other than a plain tensor")
    return _rebuild_tensor_v2(*args)


def _size(dims: Any) -> torch.Size:
    return torch.Size(_ints("size", dims))


def _device(*args: Any) -> str:
    if not args or not all(type(a) in (str, int) for a in args):
        raise Refused("torch.device of something other than a name and an index")
    return ":".join(str(a) for a in args)


def _ordered_dict(*args: Any) -> collections.OrderedDict:
    if args:
        raise Refused("OrderedDict built from arguments (torch.save fills it item by item)")
    return collections.OrderedDict()


def _zero_stage(value: Any) -> int:
    if type(value) is not int:
        raise Refused(f"ZeroStageEnum({str(value)[:40]}), not a stage number")
    return value


_TENSOR = _Marker()

# module.name -> what it resolves to: the only names a file may use
_ALLOWED: dict[str, Any] = {
    "torch._utils._rebuild_tensor_v2": Call(_rebuild_tensor_v2),
    "torch._utils._rebuild_parameter": Call(_rebuild_parameter),
    "torch._tensor._rebuild_from_type_v2": Call(_rebuild_from_type_v2),
    "torch.Tensor": _TENSOR,
    "torch.Size": Call(_size),
    "torch.device": Call(_device),
    "torch.storage.UntypedStorage": _StorageType(None),
    "collections.OrderedDict": Call(_ordered_dict),
    "deepspeed.runtime.zero.config.ZeroStageEnum": Call(_zero_stage),
    **{f"torch.{k}": _StorageType(v) for k, v in _STORAGES.items()},
    **{f"torch.{d}": getattr(torch, d) for d in _DTYPES},
    **{f"deepspeed.{c}": Class(f"deepspeed.{c}") for c in (
        "utils.tensor_fragment.fragment_address", "runtime.fp16.loss_scaler.LossScaler",
        "runtime.fp16.loss_scaler.DynamicLossScaler")},
}


def _names(file: Path) -> Any:
    def find(module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full not in _ALLOWED:
            raise CheckpointError(f"checkpoint file {file} names {full}, which fz does not load: "
                                  "not read (unpickling it could run code)")
        return _ALLOWED[full]
    return find


def _storages(archive: Archive) -> Any:
    def storage(pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise CheckpointError(f"checkpoint file {archive.file} has a persistent id {str(pid)[:80]!r} that is "
                                  "not a torch storage: not read")
        _, kind, key, _, numel = pid
        dtype = torch.uint8 if kind.dtype is None else kind.dtype  # an UntypedStorage is bytes
        at, size = archive.storage(key)
        if type(numel) is not int or not 0 <= numel * dtype.itemsize <= size:
            raise CheckpointError(f"checkpoint file {archive.file}: storage data/{key} holds {size} bytes, not "
                                  f"{numel} x {dtype} (a truncated or damaged file)")
        return _Storage(archive.file, at, dtype, numel)
    return storage


def load(path: str | os.PathLike[str]) -> Any:
    """The object a torch.save zip file holds, with tensors as `Lazy` and DeepSpeed's objects as
    `DSObject`; a file naming anything outside the table is refused unread."""
    file = Path(path)
    try:
        archive = open_archive(file)
        return ds_opcodes.parse(archive.pickle, _names(file), _storages(archive), (Lazy, torch.dtype))
    except CheckpointError:
        raise
    except Refused as e:
        raise CheckpointError(f"checkpoint file {file} is damaged or not a checkpoint fz reads: {e}: not read") from e
    except OSError as e:
        raise CheckpointError(f"checkpoint file {file} cannot be read ({e.strerror or e})") from e
    except (zipfile.BadZipFile, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError, OverflowError,
            struct.error) as e:
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


def plain(x: Any, numbers: bool = True, storages: dict | None = None) -> Any:
    """DSObjects as dicts ({"class": ..., **state}), tensors read (scalar ones as numbers, for the public
    fields: `numbers`; the client state keeps them as tensors, as DeepSpeed returns them). Each storage
    is read once and its tensors are views of it, as torch.load makes them: what a file's references
    cost is bounded by its bytes (a list naming one tensor a million times is one tensor)."""
    storages = {} if storages is None else storages
    if isinstance(x, DSObject):
        return {"class": x.cls, **{k: plain(v, numbers, storages) for k, v in x.state.items()}}
    if isinstance(x, Lazy):
        key = (x.file, x.at, x.dtype)
        if key not in storages:
            storages[key] = materialize(Lazy(x.file, x.at, x.dtype, x.storage_numel, 0,
                                                       (x.storage_numel,), (1,)))
        t = storages[key].as_strided(x.shape, x.stride, x.offset)
        return t.item() if numbers and x.numel == 1 else t
    if isinstance(x, dict):
        kind = collections.OrderedDict if isinstance(x, collections.OrderedDict) else dict  # param_shapes' order
        return kind((k, plain(v, numbers, storages)) for k, v in x.items())
    if isinstance(x, list | tuple):
        return type(x)(plain(v, numbers, storages) for v in x)
    return x
