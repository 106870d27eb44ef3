"""safetensors in and out, one tensor at a time.

`StreamWriter` writes the header (known up front from shapes and dtypes) and then each
tensor's bytes as it comes, so exporting never holds more than one tensor: safetensors'
own `save_file` needs the whole dict in memory. Reading them back into a state is
`fz.load_weights` (fz/ckpt/hf/pretrained.py, re-exported here).
"""
from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from fz.ckpt.hf.pretrained import load_weights
from fz.ckpt.hf.weights import DTYPES
from fz.ckpt.layout import PathLike, fsync_path
from fz.errors import CheckpointError, ConfigError
from fz.storage.fresh import open_fresh

__all__ = ["DTYPES", "StreamWriter", "load_weights"]



class StreamWriter:
    """Write a safetensors file tensor by tensor, or chunk by chunk in any order; `close`
    checks that every byte of every tensor was written."""

    def __init__(self, path: PathLike, entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        self.expected: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, dtype, shape in entries:
            if dtype not in DTYPES:
                raise ConfigError(f"safetensors cannot store {name!r} of dtype {dtype}")
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self.expected[name] = (dtype, tuple(shape), offset, nbytes)
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.f = open_fresh(self.tmp)  # a planted link of that name is removed, never written through
        self.f.write(len(raw).to_bytes(8, "little") + raw)
        self.f.flush()
        self.data_start = 8 + len(raw)
        self.written = {name: 0 for name in self.expected}

    def write(self, name: str, t: Tensor) -> None:
        """The whole tensor `name`."""
        self.write_chunk(name, (0,) * t.dim(), t)

    def write_chunk(self, name: str, offsets: Sequence[int], chunk: Tensor) -> None:
        """The box of tensor `name` that starts at `offsets` (chunks must not overlap)."""
        dtype, shape, start, _ = self.expected.get(name, (None, (), 0, 0))
        box = tuple(chunk.shape)
        if (dtype is None or chunk.dtype != dtype or len(offsets) != len(shape) or len(box) != len(shape)
                or any(o < 0 or o + n > s for o, n, s in zip(offsets, box, shape))):
            raise CheckpointError(f"StreamWriter: got {name} {chunk.dtype} {box} at {tuple(offsets)}, "
                              f"expected a part of {name} {dtype} {shape}")
        data = chunk.contiguous().reshape(-1).view(torch.uint8).numpy().data
        for at, run in _runs(shape, offsets, box, dtype.itemsize):
            self._pwrite(data[:run], self.data_start + start + at)
            data = data[run:]
        self.written[name] += chunk.numel() * dtype.itemsize

    def write_flat(self, name: str, at: int, chunk: Tensor) -> None:
        """Elements [at, at + chunk.numel()) of tensor `name`, flattened (a stream of 1-D chunks)."""
        dtype, shape, start, nbytes = self.expected.get(name, (None, (), 0, 0))
        size = chunk.numel() * chunk.element_size()
        if dtype is None or chunk.dtype != dtype or at < 0 or (at * dtype.itemsize + size > nbytes):
            raise CheckpointError(f"StreamWriter: got {name} {chunk.dtype} elements {at}..{at + chunk.numel()}, "
                                  f"expected a part of {name} {dtype} {shape}")
        self._pwrite(chunk.contiguous().reshape(-1).view(torch.uint8).numpy().data,
                     self.data_start + start + at * dtype.itemsize)
        self.written[name] += size

    def _pwrite(self, data: memoryview, at: int) -> None:
        while len(data):
            n = os.pwrite(self.f.fileno(), data, at)
            data, at = data[n:], at + n

    def close(self) -> None:
        """Finish atomically: fsync, then rename over the destination."""
        short = [n for n, (_, _, _, nbytes) in self.expected.items() if self.written[n] != nbytes]
        if short:
            raise CheckpointError(f"StreamWriter: {len(short)} tensors were not written completely ({short[0]}, ...)")
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)
        fsync_path(self.path.parent)

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


def _runs(shape: tuple[int, ...], offsets: Sequence[int], box: tuple[int, ...], itemsize: int):
    """(byte offset, byte length) of each contiguous run of a box of a row-major tensor, in
    order: one run for a box of whole rows (a Shard(0) chunk), more for other boxes."""
    k = len(shape)  # dims from k on are whole: the box is contiguous over them
    while k > 0 and offsets[k - 1] == 0 and box[k - 1] == shape[k - 1]:
        k -= 1
    if k == 0 or math.prod(box) == 0:
        yield 0, math.prod(box) * itemsize
        return
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    run = box[k - 1] * strides[k - 1] * itemsize
    for lead in itertools.product(*(range(n) for n in box[:k - 1])):
        first = sum((o + i) * st for o, i, st in zip(offsets, lead, strides)) + offsets[k - 1] * strides[k - 1]
        yield first * itemsize, run
