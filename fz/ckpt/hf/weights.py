"""A safetensors weights source, read without unpickling and without mapping whole files.

`WeightFiles(path)` takes a `.safetensors` file, or a Hugging Face model folder: with
`model.safetensors.index.json` its `weight_map` says which shard holds each tensor; without
one, the folder's `*.safetensors` files are read (`model.safetensors` alone, as
`save_pretrained` writes a model that fits one shard). Only each file's header is parsed
(8 bytes of length, then JSON: nothing is unpickled); a folder holding only pickled weights
(`pytorch_model.bin`, `*.pt`, ...) is refused, never opened, because loading a pickle can run
code. Every file of a folder (the index, each shard) must lie inside it: a symlink out of the
folder is refused, never read, but for a Hub cache snapshot's links into its repo's `blobs`
(fz/ckpt/hf/cache.py).

Values are read with `os.pread` into a buffer of one bounded chunk (`read`), never through
`safe_open`'s memory map: pages of a mapped file that were touched count in the process's
resident memory until the file is closed, so mapping each shard would grow the RSS by the
whole shard even though every rank reads only its rows.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from fz.ckpt.hf import st_header
from fz.ckpt.hf.cache import in_folder
from fz.ckpt.hf.st_header import DTYPES, read_json
from fz.ckpt.regular import open_regular, plain_name
from fz.errors import CheckpointError

__all__ = ["CHUNK_BYTES", "DTYPES", "Entry", "WeightFiles", "read", "read_all", "read_range"]
INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
_PICKLES = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt")
CHUNK_BYTES = 16 << 20  # one read's buffer: a tensor larger than this is read in pieces


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its dtype, shape, and where its bytes are."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _header(f: Path) -> dict[str, Entry]:
    """The tensors of one safetensors file, from its header (validated: fz/ckpt/hf/st_header.py)."""
    return {name: Entry(f, dtype, shape, begin) for name, (dtype, shape, begin) in st_header.header(f).items()}


def _refuse_pickles(folder: Path) -> None:
    found = sorted(p.name for pattern in _PICKLES for p in folder.glob(pattern))
    if found:
        raise CheckpointError(
            f"{folder} holds pickled weights ({', '.join(found[:3])}) and no safetensors: not read: a pickle can run "
            "code. Convert it to safetensors with transformers, in a process you trust with that code: "
            "`AutoModelForCausalLM.from_pretrained(folder, use_safetensors=False).save_pretrained(out)` "
            "(or the Hugging Face Hub's safetensors convert space)")
    raise CheckpointError(f"{folder} holds no weights: no {INDEX}, no *.safetensors file")


class WeightFiles:
    """Every tensor of a safetensors file or an HF folder, by name: {name: Entry}."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = p = Path(path)
        self.entries: dict[str, Entry] = {}
        if p.is_dir():
            if (p / INDEX).exists():
                self.entries = self._indexed(p)
                return
            files = [in_folder(p, f) for f in sorted(p.glob("*.safetensors"))]
            if not files:
                _refuse_pickles(p)
        elif p.exists():
            files = [p]  # a FIFO or a device is refused by the header's reader, never opened blocking
        else:
            raise CheckpointError(f"weights {p} do not exist")
        for f in files:
            for name, e in _header(f).items():
                if name in self.entries:
                    raise CheckpointError(f"weights {p}: tensor {name!r} is in both {self.entries[name].file.name} and "
                                          f"{f.name}")
                self.entries[name] = e

    @staticmethod
    def _indexed(folder: Path) -> dict[str, Entry]:
        """The index's weight_map, each shard's header read once; every file it names must exist
        inside the folder and hold the tensors it is said to."""
        index = read_json(in_folder(folder, folder / INDEX, "safetensors index"), what="safetensors index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{folder / INDEX} is not a safetensors index (it has no weight_map object)")
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(str(file), []).append(name)
        entries: dict[str, Entry] = {}
        for file, names in by_file.items():
            f = folder / file
            if not plain_name(file) or Path(file).name != file or not file.endswith(".safetensors"):
                raise CheckpointError(f"{folder / INDEX} names {file[:100]!r} for {names[0][:100]!r}: not a "
                                      ".safetensors file in the folder")
            if not f.exists():
                raise CheckpointError(f"{folder / INDEX} names {file} (for {len(names)} tensors, e.g. {names[0]!r}), "
                                      f"which does not exist in {folder}: a shard is missing (an interrupted "
                                      "download?)")
            header = _header(in_folder(folder, f))
            absent = [n for n in names if n not in header]
            if absent:
                raise CheckpointError(f"{folder / INDEX} puts {len(absent)} tensors in {file} that it does not hold "
                                      f"(e.g. {absent[0][:100]!r}): the index and the shards do not match")
            entries.update((n, header[n]) for n in names)
        return entries


def read(e: Entry, lo: int, hi: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, Tensor]]:
    """Elements [lo, hi) of the flattened tensor `e` in the file's dtype, as (first element,
    1-D chunk) pieces of at most `chunk_bytes` (at least one element): the only memory a read holds."""
    return read_range(e.file, e.begin, e.dtype, lo, hi, chunk_bytes)


def read_range(file: Path, begin: int, dtype: torch.dtype, lo: int, hi: int, chunk_bytes: int = CHUNK_BYTES,
               what: str = "weights file") -> Iterator[tuple[int, Tensor]]:
    """Elements [lo, hi) of the `dtype` array whose element 0 is at byte `begin` of `file`, read
    with os.pread into one buffer per chunk of at most `chunk_bytes`."""
    step = max(1, chunk_bytes // dtype.itemsize)
    fd = open_regular(file, what)
    try:
        at = lo
        while at < hi:
            n = min(step, hi - at)
            buf = torch.empty(n * dtype.itemsize, dtype=torch.uint8)
            view, off, done = buf.numpy().data, begin + at * dtype.itemsize, 0
            while done < len(view):
                got = os.preadv(fd, [view[done:]], off + done)
                if got <= 0:
                    raise CheckpointError(f"{what} {file} ends early at byte {off + done} (truncated?)")
                done += got
            yield at, buf.view(dtype)
            at += n
    finally:
        os.close(fd)


def read_all(e: Entry) -> Tensor:
    """The whole tensor `e` (for conversions that need it whole, and for buffers)."""
    out = torch.empty(e.shape, dtype=e.dtype)
    flat = out.view(-1)
    for at, chunk in read(e, 0, e.numel):
        flat[at:at + chunk.numel()].copy_(chunk)
    return out
