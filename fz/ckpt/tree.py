"""A State as DCP's flat {key: tensor} dict, and JSON-able trees with tensors taken out.

Keys are '/'-joined paths, so they are stable across stages, world sizes and precisions:
    step, model/<param>, opt/<path in the optimizer pytree>, scaler/<k>, buffers/<name>,
    rng/<rank>, data/<rank>/<path>, client/<path>
`model/` holds the source of truth for the weights: the fp32 master weights when the
state has them, else the parameters. Per-rank values (rng, data) carry the rank in the
key because DCP writes a plain tensor once, as if every rank held the same one.
"""
from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.distributed.tensor import DTensor

from fz.errors import ConfigError
from fz.state import State

_TENSOR, _TUPLE = "__fz_tensor__", "__fz_tuple__"
# what a script's client state holds besides (DeepSpeed pickles it): argparse's Namespace (a dict of its
# attributes) and numpy's arrays and scalars (a tensor of the same dtype); rebuilt as data, nothing run
_NAMESPACE, _NDARRAY, _NPSCALAR = "__fz_namespace__", "__fz_ndarray__", "__fz_npscalar__"
_REFS = (_TENSOR, _NDARRAY, _NPSCALAR)
MAX_DEPTH = 256  # nesting of a data or client tree fz.save writes
MAX_ENCODED_DEPTH = 2 * MAX_DEPTH + 1  # the same encoded (a tuple and a tensor are one dict deeper): restore's limit


def too_deep(obj: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether a tree of dicts, lists and tuples nests deeper than `limit` (found without recursion)."""
    stack = [(obj, 1)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, (dict, list, tuple)):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in (x.values() if isinstance(x, dict) else x))
    return False


def path_key(path: Sequence[Any]) -> str:
    parts = []
    for e in path:
        if isinstance(e, pytree.MappingKey):
            parts.append(str(e.key))
        elif isinstance(e, pytree.SequenceKey):
            parts.append(str(e.idx))
        elif isinstance(e, pytree.GetAttrKey):
            parts.append(e.name)
        else:
            parts.append(str(e))
    return "/".join(parts)


def opt_leaves(opt_state: Any) -> dict[str, Tensor]:
    """{opt/<path>: tensor} for every tensor leaf of the optimizer state."""
    leaves, _ = pytree.tree_flatten_with_path(opt_state)
    return {"opt/" + path_key(p): x for p, x in leaves if isinstance(x, Tensor)}


def weights(state: State) -> dict[str, DTensor]:
    """The weights' source of truth: fp32 master weights when present, else the parameters."""
    return state.master if state.master is not None else state.params


def entries(state: State) -> dict[str, Tensor]:
    """Every tensor of the state except the per-rank ones (rng, data), by checkpoint key."""
    out: dict[str, Tensor] = {"step": state.step}
    out.update((f"model/{n}", t) for n, t in weights(state).items())
    out.update(opt_leaves(state.opt_state))
    out.update((f"scaler/{k}", t) for k, t in (state.scaler or {}).items())
    out.update((f"buffers/{n}", t) for n, t in state.buffers.items())
    return out


def encode(obj: Any, prefix: str) -> tuple[Any, dict[str, Tensor]]:
    """A JSON-able copy of `obj` with each tensor replaced by a reference to `prefix/<path>`."""
    if too_deep(obj):
        raise ConfigError(f"checkpoint {prefix}: it nests deeper than {MAX_DEPTH} levels, more than fz.restore reads")
    tensors: dict[str, Tensor] = {}

    def go(x: Any, path: str) -> Any:
        if isinstance(x, Tensor):
            tensors[f"{prefix}/{path}"] = x
            return {_TENSOR: f"{prefix}/{path}"}
        if isinstance(x, dict):
            bad = [k for k in x if not isinstance(k, str)]
            if bad:
                raise ConfigError(f"checkpoint {prefix} at {path or '<root>'!r}: dict keys must be str, got {bad[0]!r}")
            return {k: go(v, f"{path}/{k}" if path else k) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            items = [go(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(x)]
            return {_TUPLE: items} if isinstance(x, tuple) else items
        if type(x).__module__ == "numpy" and hasattr(x, "dtype") and x.dtype.kind in "biufc":
            import numpy as np
            mark = _NDARRAY if isinstance(x, np.ndarray) else _NPSCALAR
            tensors[f"{prefix}/{path}"] = torch.from_numpy(np.array(x, copy=True))
            return {mark: f"{prefix}/{path}"}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, argparse.Namespace):
            return {_NAMESPACE: go(vars(x), path)}
        raise ConfigError(f"checkpoint {prefix} at {path or '<root>'!r}: {type(x).__name__} is neither "
                          "JSON-able nor a tensor (nor an argparse.Namespace or numeric numpy array, which are kept)")

    return go(obj, ""), tensors


def tensor_refs(obj: Any) -> list:
    """The tensor keys an encoded tree refers to."""
    if isinstance(obj, dict):
        if len(obj) == 1 and next(iter(obj)) in _REFS:
            return [next(iter(obj.values()))]
        return [k for v in obj.values() for k in tensor_refs(v)]
    if isinstance(obj, list):
        return [k for v in obj for k in tensor_refs(v)]
    return []


def decode(obj: Any, tensors: dict[str, Tensor]) -> Any:
    """Inverse of `encode`."""
    if isinstance(obj, dict):
        if len(obj) == 1 and _TENSOR in obj:
            return tensors[obj[_TENSOR]]
        if len(obj) == 1 and _TUPLE in obj:
            return tuple(decode(v, tensors) for v in obj[_TUPLE])
        if len(obj) == 1 and _NAMESPACE in obj and isinstance(obj[_NAMESPACE], dict):
            return argparse.Namespace(**decode(obj[_NAMESPACE], tensors))
        if len(obj) == 1 and (_NDARRAY in obj or _NPSCALAR in obj):
            ref = obj[_NDARRAY] if _NDARRAY in obj else obj[_NPSCALAR]
            array = tensors[ref].numpy().copy()
            return array if _NDARRAY in obj else array[()]
        return {k: decode(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v, tensors) for v in obj]
    return obj


def _tensor_bytes(t: Tensor) -> bytes:
    t = t.detach().cpu()
    if t.layout != torch.strided:
        t = t.to_dense()
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def digests(obj: Any, tensors: dict[str, Tensor]) -> dict[str, str]:
    """{top-level key: sha256 of its value} of an encoded dict (`encode`'s output and tensors):
    ranks holding equal values get equal digests."""
    out = {}
    for k, v in (obj.items() if isinstance(obj, dict) else [("<root>", obj)]):
        h = hashlib.sha256(json.dumps(v, sort_keys=True).encode())
        for ref in tensor_refs(v):
            t = tensors[ref]
            h.update(f"{ref}|{t.dtype}|{tuple(t.shape)}|{t.layout}".encode())
            h.update(_tensor_bytes(t))
        out[k] = h.hexdigest()
    return out
