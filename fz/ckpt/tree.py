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

from fz.ckpt.index import DTYPES
from fz.errors import CheckpointError, ConfigError
from fz.state import State

_TENSOR, _TUPLE = "__fz_tensor__", "__fz_tuple__"
# what a script's client state holds besides (DeepSpeed pickles it): argparse's Namespace (a dict of its
# attributes) and numpy's arrays and scalars (a tensor of the same dtype); rebuilt as data, nothing run
_NAMESPACE = "__fz_namespace__"
_UNSIGNED = ("uint16", "uint32", "uint64")  # saved as the signed integers of their width, viewed back
_NUMPY = {f"__fz_{kind}{'_' + u if u else ''}__": (kind == "npscalar", u)  # marker: (a scalar, its unsigned dtype)
          for kind in ("ndarray", "npscalar") for u in (None, *_UNSIGNED)}
_REFS = (_TENSOR, *_NUMPY)
MARKERS = (_TUPLE, _NAMESPACE, *_REFS)
_NAMESPACE_OWN = frozenset(dir(argparse.Namespace))  # its methods: an attribute of that name would shadow one
# nesting of a data or client tree fz.save writes: its encoder recurses, two frames a level (and comprehensions),
# so this stays well inside Python's recursion limit of 1000 under a caller's own frames
MAX_DEPTH = 100
# the restore's limit, encoded (a tuple and a tensor are one dict deeper): what fz.save wrote before it took 100
# levels (256), read without recursion
MAX_ENCODED_DEPTH = 2 * 256 + 1


def too_deep(obj: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether a tree of dicts, lists and tuples nests deeper than `limit` (found without recursion)."""
    stack = [(obj, 1)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, argparse.Namespace):
            x = vars(x)
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
        raise ConfigError(f"checkpoint {prefix}: it nests deeper than {MAX_DEPTH} levels, the most fz.save writes")
    tensors: dict[str, Tensor] = {}

    def go(x: Any, path: str) -> Any:
        where = f"checkpoint {prefix} at {path or '<root>'!r}"
        if isinstance(x, Tensor):
            if str(x.dtype).removeprefix("torch.") not in DTYPES:
                raise ConfigError(f"{where}: a {x.dtype} tensor, which fz's checkpoints do not hold")
            tensors[f"{prefix}/{path}"] = x
            return {_TENSOR: f"{prefix}/{path}"}
        if isinstance(x, dict):
            bad = [k for k in x if not isinstance(k, str)]
            if bad:
                raise ConfigError(f"{where}: dict keys must be str, got {bad[0]!r}")
            if len(x) == 1 and next(iter(x)) in MARKERS:
                raise ConfigError(f"{where}: a dict whose one key is {next(iter(x))!r}, which fz's checkpoints use "
                                  "to mark what they encode")
            return {k: go(v, f"{path}/{k}" if path else k) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            items = [go(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(x)]
            return {_TUPLE: items} if isinstance(x, tuple) else items
        if type(x).__module__ == "numpy" and hasattr(x, "dtype"):
            return _numpy(x, f"{prefix}/{path}", where, tensors)
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, argparse.Namespace):
            own = [k for k in vars(x) if k in _NAMESPACE_OWN or _dunder(k)]
            if own:
                raise ConfigError(f"{where}: an argparse.Namespace with an attribute {own[0]!r} that shadows its own")
            return {_NAMESPACE: go(vars(x), path)}
        raise ConfigError(f"{where}: {type(x).__name__} is neither JSON-able nor a tensor (nor an "
                          "argparse.Namespace or numeric numpy array, which are kept)")

    return go(obj, ""), tensors


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _numpy(x: Any, ref: str, where: str, tensors: dict[str, Tensor]) -> dict[str, str]:
    """A numpy array or scalar as a reference to a tensor of its values (native byte order; an
    unsigned dtype torch's checkpoints lack as the signed one of its width, its marker naming it)."""
    import numpy as np

    array = np.array(x, copy=True)
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    unsigned = array.dtype.name if array.dtype.name in _UNSIGNED else None
    if unsigned:
        array = array.view(f"int{array.dtype.itemsize * 8}")
    try:
        t = torch.from_numpy(array) if array.dtype.kind in "biufc" else None
    except (TypeError, ValueError):
        t = None
    if t is None or str(t.dtype).removeprefix("torch.") not in DTYPES:
        raise ConfigError(f"{where}: a numpy {x.dtype} value, which fz's checkpoints do not hold")
    tensors[ref] = t
    return {f"__fz_{'ndarray' if isinstance(x, np.ndarray) else 'npscalar'}{'_' + unsigned if unsigned else ''}__": ref}


def malformed(obj: Any) -> str | None:
    """What in an encoded tree `encode` never writes (a marker whose body is not what it marks), or
    None; found without recursion, before any of it is decoded."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, list):
            stack.extend(x)
            continue
        if not isinstance(x, dict):
            continue
        mark = next(iter(x)) if len(x) == 1 else None
        body = x[mark] if mark in MARKERS else None
        if mark in _REFS and not isinstance(body, str):
            return f"a {mark} reference that is a {type(body).__name__}, not a key"
        if mark == _TUPLE and not isinstance(body, list):
            return f"a tuple whose items are a {type(body).__name__}, not a list"
        if mark == _NAMESPACE:
            if not isinstance(body, dict):
                return f"an argparse.Namespace whose attributes are a {type(body).__name__}, not a dict"
            own = [k for k in body if k in _NAMESPACE_OWN or _dunder(k)]
            if own:
                return f"an argparse.Namespace with an attribute {own[0][:40]!r} that shadows its own"
        stack.extend(x.values())
    return None


def tensor_refs(obj: Any) -> list:
    """The tensor keys an encoded tree refers to, in order (found without recursion)."""
    out, stack = [], [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if len(x) == 1 and next(iter(x)) in _REFS:
                out.append(next(iter(x.values())))
            else:
                stack.extend(reversed(list(x.values())))
        elif isinstance(x, list):
            stack.extend(reversed(x))
    return out


def _children(x: Any) -> list | None:
    """An encoded node's encoded children (None: a leaf, decoded by `_leaf`)."""
    if isinstance(x, list):
        return x
    if not isinstance(x, dict):
        return None
    mark = next(iter(x)) if len(x) == 1 else None
    if mark in _REFS:
        return None
    if mark == _TUPLE:
        return list(x[_TUPLE])
    if mark == _NAMESPACE:
        return [x[_NAMESPACE]]
    return list(x.values())


def _leaf(x: Any, tensors: dict[str, Tensor]) -> Any:
    if isinstance(x, dict) and _TENSOR in x:
        return tensors[x[_TENSOR]]
    if isinstance(x, dict):
        return _numpy_value(*next(iter(x.items())), tensors)
    return x


def _built(x: Any, items: list) -> Any:
    """An encoded node rebuilt from its decoded children."""
    if isinstance(x, list):
        return items
    if len(x) == 1 and _TUPLE in x:
        return tuple(items)
    if len(x) == 1 and _NAMESPACE in x:
        body = items[0]
        if not isinstance(body, dict) or any(k in _NAMESPACE_OWN or _dunder(k) for k in body):
            raise CheckpointError("a saved argparse.Namespace is not a dict of attribute names: damaged or altered")
        return argparse.Namespace(**body)
    return dict(zip(x.keys(), items))


def decode(obj: Any, tensors: dict[str, Tensor]) -> Any:
    """Inverse of `encode`; without recursion, so a tree as deep as the restore's limit (as deep as
    an older fz saved) decodes within any caller's stack."""
    done: list[Any] = []
    stack: list[tuple[Any, int]] = [(obj, -1)]  # (node, -1: to expand; n >= 0: build from its n children)
    while stack:
        x, n = stack.pop()
        if n >= 0:
            items = done[len(done) - n:] if n else []
            del done[len(done) - n:]
            done.append(_built(x, items))
            continue
        kids = _children(x)
        if kids is None:
            done.append(_leaf(x, tensors))
            continue
        stack.append((x, len(kids)))
        stack.extend((k, -1) for k in reversed(kids))
    return done[0]


def _numpy_value(mark: str, ref: str, tensors: dict[str, Tensor]) -> Any:
    """The numpy array or scalar `encode` saved as `mark`: the tensor's values, viewed back as the
    unsigned dtype the marker names."""
    scalar, unsigned = _NUMPY[mark]
    t = tensors[ref]
    try:
        array = t.numpy().copy()
    except (TypeError, RuntimeError) as e:
        raise CheckpointError(f"a saved numpy value ({ref}) is a {t.dtype} tensor: damaged or altered") from e
    if unsigned:
        if array.dtype.kind != "i" or array.dtype.itemsize * 8 != int(unsigned.removeprefix("uint")):
            raise CheckpointError(f"a saved numpy {unsigned} value ({ref}) is {array.dtype}: damaged or altered")
        array = array.view(unsigned)
    if scalar:
        if array.ndim:
            raise CheckpointError(f"a saved numpy scalar ({ref}) has shape {array.shape}: damaged or altered")
        return array[()]
    return array


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
