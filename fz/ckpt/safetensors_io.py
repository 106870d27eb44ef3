"""safetensors in and out, one tensor at a time.

`StreamWriter` writes the header (known up front from shapes and dtypes) and then each
tensor's bytes as it comes, so exporting never holds more than one tensor: safetensors'
own `save_file` needs the whole dict in memory. `load_weights` fills a state from such a
file with `safe_open(...).get_slice`, so each rank reads only the rows it holds.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from fz.ckpt.layout import PathLike, fsync_path
from fz.errors import CheckpointError, ConfigError
from fz.state import State, block_until_ready, expect_state

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}


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
        self.f = open(self.tmp, "wb")
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


def _files(path: PathLike) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{p} holds no *.safetensors file")
        return files
    if not p.is_file():
        raise CheckpointError(f"weights file {p} does not exist")
    return [p]


def _open(safe_open, f: Path):
    try:
        return safe_open(str(f), framework="pt")
    except Exception as e:  # noqa: BLE001 - a damaged file, named
        raise CheckpointError(f"weights file {f} is unreadable ({type(e).__name__}: {e})") from e


def _local_rows(t: DTensor) -> tuple[int, int]:
    """[start, stop) rows of dim 0 this rank holds (torch.chunk semantics, as Shard(0))."""
    rows, world = t.shape[0], t.device_mesh.size()
    rank = t.device_mesh.get_local_rank()
    chunk = -(-rows // world)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def _fill(target: DTensor, handle, name: str) -> None:
    local = target._local_tensor
    if isinstance(target.placements[0], Shard) and len(target.shape):
        start, stop = _local_rows(target)
        if stop > start:
            local.copy_(handle.get_slice(name)[start:stop])
    else:
        local.copy_(handle.get_tensor(name))


def load_weights(state: State, path: PathLike, *, strict: bool = True) -> State:
    """Fill the parameters (and fp32 master weights) and the state_dict's buffers (the persistent
    ones, e.g. BatchNorm's statistics) from a safetensors file or directory.

    Names are the canonical parameter and buffer names (fz.full_params's keys, the HF convention).
    Each rank reads only its own rows of a sharded tensor. The optimizer state is kept.
    Missing, unexpected or mis-shaped tensors are a ConfigError (strict=False: a warning,
    and the tensors both have are loaded). Returns the state (filled in place).
    """
    from safetensors import safe_open

    expect_state(state, "fz.load_weights")
    state = block_until_ready(state)
    files = _files(path)
    handles = [_open(safe_open, f) for f in files]
    where = {k: h for h in handles for k in h.keys()}
    buffers = {n: state.buffers[n] for n in state.skeleton.persistent if n in state.buffers}
    expected = {**state.params, **buffers}
    problems = [f"missing: {n}" for n in expected if n not in where]
    problems += [f"unexpected: {k}" for k in where if k not in expected]
    for n, p in expected.items():
        if n in where and tuple(where[n].get_slice(n).get_shape()) != tuple(p.shape):
            problems.append(f"shape mismatch: {n} is {tuple(where[n].get_slice(n).get_shape())} in the file, "
                            f"{tuple(p.shape)} here")
    if problems:
        msg = f"weights {path} do not match this model ({len(problems)} differences): " + "; ".join(problems[:5])
        if strict:
            raise CheckpointError(msg + ("; ..." if len(problems) > 5 else ""))
        warnings.warn(msg, stacklevel=2)
    bad = {p.split(": ", 1)[1].split(" ")[0] for p in problems}
    with torch.no_grad():
        for n, p in state.params.items():
            if n in bad:
                continue
            try:
                _fill(p, where[n], n)
                if state.master is not None:
                    _fill(state.master[n], where[n], n)
            except Exception as e:  # noqa: BLE001 - a damaged file, named
                raise CheckpointError(f"cannot read {n} from weights file {files[handles.index(where[n])]} "
                                  f"({type(e).__name__}: {e})") from e
        for n, b in buffers.items():
            if n in where and n not in bad:
                b.copy_(where[n].get_tensor(n))
    return state
