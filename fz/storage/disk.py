"""`DiskTensor`: a State leaf whose values live in a file (the NVMe tier), as a tensor.

A DiskTensor has a shape and dtype but no memory: it names extents (byte ranges) of a
`Blob`, one raw file of the offload store. Like a JAX array on another memory kind it is
a value: views of it (a parameter inside a bucket's storage) are DiskTensors of the
sub-ranges; anything that reads values loads them (that one tensor, then frees it);
`copy_` into it writes the file; `clone` copies the bytes into a new file, so a copied
state keeps its tier. The step's optimizer never goes through this per-op path: it
streams whole groups of rows with its own buffers (fz/step/stream.py).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from fz.storage.blob import Blob, Extents, sub_extents

aten = torch.ops.aten

_SHAPE_ONLY = {aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
               aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
               aten.new_empty_strided.default}
_SAME = {aten.detach.default, aten.alias.default}
_RESHAPE = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten._reshape_alias.default}


class DiskTensor(Tensor):
    """A contiguous tensor whose bytes are `extents` of `blob`; loads to `device` when read."""

    _blob: Blob
    _extents: Extents

    @staticmethod
    def __new__(cls, blob: Blob, extents: Extents, shape: Sequence[int], dtype: torch.dtype,
                device: torch.device) -> DiskTensor:
        r = Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device, requires_grad=False)
        r._blob, r._extents = blob, tuple(extents)
        return r

    @property
    def nbytes_on_disk(self) -> int:
        return sum(n for _, n in self._extents)

    def load(self, wait: bool = True, pooled: bool = False) -> Tensor:
        """The values, read now into a new tensor on this tensor's device (`wait`, `pooled`: see
        Blob.read)."""
        raw = self._blob.read(self._extents, wait=wait, pooled=pooled)
        return raw.view(self.dtype).view(self.shape).to(self.device)

    def store(self, values: Tensor, wait: bool = True) -> None:
        """Write `values` (this shape; cast to this dtype) into the file (`wait`: see Blob.write)."""
        data = values.detach().to("cpu", self.dtype).contiguous()
        self._blob.write(self._extents, data, wait)

    def __repr__(self) -> str:  # type: ignore[override]  # torch: Tensor.__repr__(tensor_contents=) is untyped
        return f"DiskTensor(shape={tuple(self.shape)}, dtype={self.dtype}, file={self._blob.path!r})"

    def __deepcopy__(self, memo: dict[int, Any]) -> Tensor:
        return self.clone()

    def __reduce_ex__(self, proto: Any) -> Any:
        raise TypeError("a DiskTensor cannot be pickled; save the state with fz.save")

    def _sub(self, start_el: int, shape: Sequence[int]) -> DiskTensor:
        size = self.element_size()
        ext = sub_extents(self._extents, start_el * size, math.prod(shape) * size)
        return DiskTensor(self._blob, ext, shape, self.dtype, self.device)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's classmethod idiom, as DTensor's
            cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:

        kwargs = kwargs or {}
        out = _metadata_op(func, args, kwargs)
        if out is not NotImplemented:
            return out
        if func is aten.copy_.default and isinstance(args[0], DiskTensor):
            dst, src = args[0], args[1]
            dst.store((src.load() if isinstance(src, DiskTensor) else src).expand(dst.shape))
            return dst
        if func is aten.clone.default and isinstance(args[0], DiskTensor):
            return args[0].copy_to_new_blob()
        loaded = pytree.tree_map(lambda x: x.load() if isinstance(x, DiskTensor) else x, (args, kwargs))
        result = func(*loaded[0], **loaded[1])
        for i, arg in enumerate(func._schema.arguments):  # in-place ops: write the new values back
            if arg.alias_info is not None and arg.alias_info.is_write:
                orig = args[i] if i < len(args) else kwargs.get(arg.name)
                new = loaded[0][i] if i < len(args) else loaded[1].get(arg.name)
                for o, n in zip(_as_list(orig), _as_list(new)):
                    if isinstance(o, DiskTensor):
                        o.store(n)
        return result

    def copy_to_new_blob(self) -> DiskTensor:
        """This tensor's bytes in a new file of the same store (a clone that stays on disk)."""
        blob = self._blob.store.new_blob("clone", self.nbytes_on_disk)
        new = DiskTensor(blob, ((0, self.nbytes_on_disk),), self.shape, self.dtype, self.device)
        step = 64 << 20
        for at in range(0, self.nbytes_on_disk, step):
            n = min(step, self.nbytes_on_disk - at)
            blob.write(((at, n),), self._blob.read(sub_extents(self._extents, at, n)))
        return new


def _as_list(x: Any) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _metadata_op(func: Any, args: tuple, kwargs: dict) -> Any:
    """Views and shape-only ops, answered without reading the file (NotImplemented: not one of them)."""
    if func in _SHAPE_ONLY:
        fake = pytree.tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype, device=x.device)
                               if isinstance(x, DiskTensor) else x, (args, kwargs))
        return func(*fake[0], **fake[1])
    t = args[0] if args else None
    if not isinstance(t, DiskTensor):
        return NotImplemented
    if func in _SAME:
        return DiskTensor(t._blob, t._extents, t.shape, t.dtype, t.device)
    if func is aten.is_pinned.default:  # DCP asks of every tensor it saves: not a reason to read the file
        return False
    if func in _RESHAPE:
        shape = torch.empty(t.shape, device="meta").view(args[1]).shape
        return t._sub(0, shape)
    row = math.prod(t.shape[1:]) if t.dim() else 1
    if func is aten.slice.Tensor:
        dim, start, end, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1:])[:4]
        if dim == 0 and step == 1:
            start, end, _ = slice(start, end).indices(t.shape[0])
            end = max(end, start)
            return t._sub(start * row, (end - start, *t.shape[1:]))
    if func in (aten.split.Tensor, aten.split_with_sizes.default) and (len(args) < 3 or args[2] == 0):
        sizes = args[1]
        if isinstance(sizes, int):
            sizes = [min(sizes, t.shape[0] - i) for i in range(0, t.shape[0], sizes)]
        out, at = [], 0
        for n in sizes:
            out.append(t._sub(at * row, (n, *t.shape[1:])))
            at += n
        return out
    return NotImplemented


def load(t: Tensor) -> Tensor:
    """`t`'s values in memory (a DiskTensor is read; anything else is returned as is)."""
    return t.load() if isinstance(t, DiskTensor) else t
